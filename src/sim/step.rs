//! The calls of a simulated engine's step ([`Call`]) and a step's program with its durations
//! and syncs ([`StepProgram`]), shared by the library's engine (`program`) and the
//! `zero3-2021` policy's (`zero3`).

use collsched_buckets::ParamId;

use super::report::SpanKind;

/// One call of the engine program.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Call {
    Phase {
        backward: bool,
    },
    Fetch(u32),
    /// Compute of a layer, or of the step outside every layer ([`NO_LAYER`]: the loss, the
    /// update).
    Compute(u32, SpanKind),
    Release(u32),
    Grad(ParamId),
    EndStep,
    /// Host time (the layer it belongs to): its nanoseconds are the program position's.
    Host(u32),
    /// A device drain: wait for every collective the rank launched, then the position's host
    /// nanoseconds.
    Drain,
}

/// The layer of a [`Call::Compute`] outside every layer.
pub(crate) const NO_LAYER: u32 = u32::MAX;

/// One step's program with its durations (host time for [`Call::Host`] and [`Call::Drain`],
/// compute time for [`Call::Compute`]) and its host-device syncs per position.
#[derive(Default)]
pub(crate) struct StepProgram {
    pub(crate) program: Vec<Call>,
    pub(crate) ns: Vec<f64>,
    pub(crate) syncs: Vec<u32>,
}

impl StepProgram {
    pub(crate) fn push(&mut self, c: Call, ns: f64, syncs: u32) {
        self.program.push(c);
        self.ns.push(ns);
        self.syncs.push(syncs);
    }

    /// Host time of the training engine's hook at layer `l`, where there is any.
    pub(crate) fn hook(&mut self, l: u32, ns: f64) {
        if ns > 0.0 {
            self.push(Call::Host(l), ns, 0);
        }
    }

    /// The step's compute outside the layers, `flops` of `kind` (the loss after the forward,
    /// the update after the step's end), where there is any.
    pub(crate) fn outside(&mut self, kind: SpanKind, flops: f64, ns_per_flop: f64) {
        if flops > 0.0 {
            self.push(Call::Compute(NO_LAYER, kind), flops * ns_per_flop, 0);
        }
    }
}
