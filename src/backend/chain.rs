//! Chained launches (`Backend::launch_then`): a second collective in stream order behind a
//! first, reading its output, with no host wait.

use std::fmt;

use super::{Backend, BackendError, CollDesc, CollRef, Collective, InFlight, LaunchError, Stream};

/// A collective launched behind an in-flight launch ([`Backend::launch_then`]) whose input is
/// the output of one collective of that launch.
#[derive(Debug)]
pub struct Chained<Buf> {
    /// What to do (a reduce-scatter or all-reduce needs its input distinct from its output, as
    /// usual: it is the earlier collective's output).
    pub desc: CollDesc,
    /// The position, in the earlier launch's group, of the collective whose output is this
    /// collective's input.
    pub input_of: usize,
    /// Where the result goes.
    pub output: Buf,
}

/// A refused [`Backend::launch_then`]: the error, the earlier launch given back still in
/// flight and unchanged, and the outputs of the refused collectives (STYLE 7).
pub struct ChainError<B: Backend> {
    /// Why.
    pub error: BackendError,
    /// The earlier launch, still in flight with all its buffers.
    pub first: InFlight<B>,
    /// The `output` buffers of the refused chained collectives, in the order given.
    pub outputs: Vec<B::Buffer>,
}

impl<B: Backend> fmt::Debug for ChainError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChainError")
            .field("error", &self.error)
            .field("first", &self.first)
            .field("outputs", &self.outputs.len())
            .finish()
    }
}

impl<B: Backend> fmt::Display for ChainError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "chained launch refused: {}", self.error)
    }
}

impl<B: Backend> std::error::Error for ChainError<B> {}

/// The stream-ordered chain behind [`Backend::launch_then`]'s provided implementation. No heap
/// allocation for up to four collectives per launch: the `Vec` of `first`'s collectives
/// carries the chained ones.
pub(super) fn launch_in_stream_order<B: Backend, I: IntoIterator<Item = Chained<B::Buffer>>>(
    backend: &B,
    mut first: InFlight<B>,
    stream: Stream,
    next: I,
) -> Result<InFlight<B>, Box<ChainError<B>>> {
    let next: smallvec::SmallVec<[Chained<B::Buffer>; 4]> = next.into_iter().collect();
    let n = first.ops.len();
    let mut taken: smallvec::SmallVec<[bool; 8]> = smallvec::smallvec![false; n];
    let mut bad = None;
    if next.is_empty() {
        bad = Some("launch_then got no collectives to chain".to_string());
    }
    for c in &next {
        match taken.get_mut(c.input_of) {
            None => {
                bad = Some(format!(
                    "input_of {} names no collective of the earlier launch (it has {n})",
                    c.input_of
                ));
            }
            Some(t) if *t => {
                bad = Some(format!("two chained collectives read the output of collective {}", c.input_of));
            }
            Some(t) => *t = true,
        }
    }
    if let Some(what) = bad {
        let op = next.first().map(|c| c.desc.clone()).or_else(|| first.descs().next().cloned());
        let error = match op {
            Some(desc) => BackendError::InvalidCollective {
                rank: backend.rank(),
                op: Box::new(CollRef { desc, stream, seq: None }),
                what,
            },
            None => BackendError::InvalidLaunch { rank: backend.rank(), what },
        };
        let outputs = next.into_iter().map(|c| c.output).collect();
        return Err(Box::new(ChainError { error, first, outputs }));
    }
    let event = first.event.clone();
    let on_drop = first.backend.take();
    let mut ops = std::mem::take(&mut first.ops);
    drop(first);
    // `first`'s collectives, each either whole or with its output lent to a chained one.
    let mut earlier: smallvec::SmallVec<[Option<Collective<B::Buffer>>; 4]> =
        ops.drain(..).map(Some).collect();
    let mut lent: smallvec::SmallVec<[Lent<B::Buffer>; 4]> = smallvec::SmallVec::new();
    for c in next {
        if let Some(e) = earlier.get_mut(c.input_of).and_then(Option::take) {
            lent.push(Lent { at: c.input_of, desc: e.desc, input: e.input });
            ops.push(Collective { desc: c.desc, input: Some(e.output), output: c.output });
        }
    }
    let fence = [event.clone()];
    match backend.launch_group(stream, &fence, ops) {
        Ok(flight) => {
            let rest = earlier.into_iter().flatten().flat_map(|c| c.input.into_iter().chain([c.output]));
            for buf in rest.chain(lent.into_iter().filter_map(|l| l.input)) {
                backend.free(buf, Some(&event));
            }
            Ok(flight)
        }
        Err(LaunchError { error, ops: mut back }) => {
            // Give `first` back whole: the refused collectives' inputs are its outputs.
            let mut outputs = Vec::with_capacity(back.len());
            let mut lent = lent.into_iter();
            for c in back.drain(..) {
                outputs.push(c.output);
                match (c.input, lent.next()) {
                    (Some(output), Some(Lent { at, desc, input })) => {
                        earlier[at] = Some(Collective { desc, input, output });
                    }
                    // A backend that did not give the ops back as launched broke the
                    // contract: keep what is left alive until `first` completed.
                    (output, lent) => {
                        let input = lent.and_then(|l| l.input);
                        for b in output.into_iter().chain(input) {
                            backend.free(b, Some(&event));
                        }
                    }
                }
            }
            for b in lent.filter_map(|l| l.input) {
                backend.free(b, Some(&event));
            }
            back.extend(earlier.into_iter().flatten());
            let first = InFlight { ops: back, event, backend: on_drop };
            Err(Box::new(ChainError { error, first, outputs }))
        }
    }
}

/// A collective of the earlier launch whose output a chained collective took: where it was,
/// and what is left of it.
struct Lent<Buf> {
    at: usize,
    desc: CollDesc,
    input: Option<Buf>,
}
