//! [`Hooks`]: the saved-tensor hooks of a sharded model's training passes, in native code
//! (torch calls them for every tensor an operation saves for its backward, activations
//! included: a few tens per unit, where a Python hook costs microseconds each).
//!
//! A saved tensor that views a gathered parameter becomes a [`Saved`] reference (parameter
//! id, size, stride, storage offset, dtype): the gathered buffer is released after the unit's
//! forward, and the backward gathers it again, maybe at another address. Unpacking a reference
//! views the parameter's full value as the tensor was; when the parameter's unit is not
//! fetched, or the backward has not begun, it calls back into Python, which does both first.
//! Every other tensor passes through.

use std::collections::BTreeMap;
use std::time::Instant;

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::{PyTraverseError, PyVisit};

/// A saved tensor that viewed parameter `pid`'s gathered value.
#[pyclass(module = "collsched._native", frozen)]
pub struct Saved {
    #[pyo3(get)]
    pid: u32,
    #[pyo3(get)]
    size: Py<PyAny>,
    #[pyo3(get)]
    stride: Py<PyAny>,
    #[pyo3(get)]
    offset: usize,
    #[pyo3(get)]
    dtype: Py<PyAny>,
}

/// One parameter's full value as a unit shows it: bytes `start..end`.
#[derive(Clone, Copy)]
struct Span {
    start: usize,
    end: usize,
    pid: u32,
}

/// The spans of the units whose parameters are gathered now, looked up by address, and the
/// hooks over them.
#[pyclass(module = "collsched._native")]
pub struct Hooks {
    /// Each unit's spans, as last set (shown or not).
    spans: Vec<Vec<Span>>,
    /// Whether each unit's spans are shown.
    shown: Vec<bool>,
    /// The shown spans by `(start, unit)` (a tied parameter is shown by each unit using it).
    live: BTreeMap<(usize, u32), Span>,
    /// Each parameter's unit (the one that fetches it for the backward).
    owner: Vec<u32>,
    /// Each parameter's full value as last shown: a tensor viewing it (not the parameter).
    views: Vec<Option<Py<PyAny>>>,
    /// Whether the backward has begun (the engine fetches for it).
    backward: bool,
    /// Python's unpacking of a [`Saved`] reference, for what this cannot do (`None` once
    /// Python's garbage collector cleared this).
    unpack_saved: Option<Py<PyAny>>,
    /// Time spent in `pack` and `unpack` (callbacks into Python excluded), in nanoseconds.
    nanos: u64,
}

impl Hooks {
    fn unit(&self, unit: u32) -> PyResult<usize> {
        let u = unit as usize;
        if u < self.spans.len() {
            Ok(u)
        } else {
            Err(crate::errors::other(format!("hooks: unit {unit} out of range ({} units)", self.spans.len())))
        }
    }

    /// The span `ptr` lies in, if a shown unit's parameter holds it.
    fn find(&self, ptr: usize) -> Option<Span> {
        let (_, s) = self.live.range(..=(ptr, u32::MAX)).next_back()?;
        (ptr < s.end).then_some(*s)
    }

    fn pack_inner<'py>(&self, t: &Bound<'py, PyAny>) -> PyResult<Option<Saved>> {
        let py = t.py();
        let Ok(ptr) = t.call_method0(intern!(py, "data_ptr")).and_then(|p| p.extract::<usize>()) else {
            // Sparse and nested tensors have no data pointer: never a view of ours.
            return Ok(None);
        };
        let Some(span) = self.find(ptr) else { return Ok(None) };
        let offset: usize = t.call_method0(intern!(py, "storage_offset"))?.extract()?;
        let item: usize = t.call_method0(intern!(py, "element_size"))?.extract()?;
        // A view of the parameter's full value: its storage begins where the value does.
        if offset.checked_mul(item).and_then(|b| ptr.checked_sub(b)) != Some(span.start) {
            return Ok(None);
        }
        Ok(Some(Saved {
            pid: span.pid,
            size: t.call_method0(intern!(py, "size"))?.unbind(),
            stride: t.call_method0(intern!(py, "stride"))?.unbind(),
            offset,
            dtype: t.getattr(intern!(py, "dtype"))?.unbind(),
        }))
    }
}

/// `t` itself, or a detached alias of it where it has a `grad_fn` (see [`Hooks::pack`]).
fn detached(t: Bound<'_, PyAny>) -> PyResult<Bound<'_, PyAny>> {
    let py = t.py();
    match t.getattr(intern!(py, "grad_fn")) {
        Ok(f) if !f.is_none() => t.call_method0(intern!(py, "detach")),
        // Not a tensor (a hook sees tensors alone), or a leaf: as it is.
        _ => Ok(t),
    }
}

#[pymethods]
impl Hooks {
    /// Python's garbage collector sees the objects this holds: the unpack callback (a bound
    /// method of the state that holds this) and the views, so that a state and its hooks,
    /// which refer to each other, are freed together once nothing else refers to them.
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(c) = &self.unpack_saved {
            visit.call(c)?;
        }
        for v in self.views.iter().flatten() {
            visit.call(v)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.unpack_saved = None;
        self.views.iter_mut().for_each(|v| *v = None);
    }

    /// Hooks for `units` units and a parameter per entry of `owner` (its unit's index);
    /// `unpack_saved(saved)` returns the tensor a [`Saved`] stands for, fetching its unit.
    #[new]
    fn new(units: usize, owner: Vec<u32>, unpack_saved: Py<PyAny>) -> PyResult<Hooks> {
        if let Some(&u) = owner.iter().find(|&&u| u as usize >= units) {
            return Err(crate::errors::other(format!("hooks: unit {u} out of range ({units} units)")));
        }
        Ok(Hooks {
            spans: vec![Vec::new(); units],
            shown: vec![false; units],
            live: BTreeMap::new(),
            views: (0..owner.len()).map(|_| None).collect(),
            owner,
            backward: false,
            unpack_saved: Some(unpack_saved),
            nanos: 0,
        })
    }

    /// Unit `unit`'s parameters are at these `(address, bytes, parameter id, view)` from now
    /// on, `view` a tensor viewing the full value (its spans are replaced, and shown if the
    /// unit's were).
    fn set_spans(&mut self, unit: u32, spans: Vec<(usize, usize, u32, Py<PyAny>)>) -> PyResult<()> {
        let u = self.unit(unit)?;
        if let Some((_, _, pid, _)) = spans.iter().find(|s| s.2 as usize >= self.views.len()) {
            return Err(crate::errors::other(format!(
                "hooks: parameter id {pid} out of range ({} parameters)",
                self.views.len()
            )));
        }
        let shown = self.shown[u];
        if shown {
            self.hide(unit)?;
        }
        let mut kept = Vec::with_capacity(spans.len());
        for (start, len, pid, view) in spans {
            self.views[pid as usize] = Some(view);
            if len > 0 {
                kept.push(Span { start, end: start.saturating_add(len), pid });
            }
        }
        self.spans[u] = kept;
        if shown {
            self.show(unit)?;
        }
        Ok(())
    }

    /// Unit `unit` is fetched: tensors viewing its parameters are saved as references.
    fn show(&mut self, unit: u32) -> PyResult<()> {
        let u = self.unit(unit)?;
        if !std::mem::replace(&mut self.shown[u], true) {
            for s in &self.spans[u] {
                self.live.insert((s.start, unit), *s);
            }
        }
        Ok(())
    }

    /// Unit `unit` is released.
    fn hide(&mut self, unit: u32) -> PyResult<()> {
        let u = self.unit(unit)?;
        if std::mem::replace(&mut self.shown[u], false) {
            for s in &self.spans[u] {
                self.live.remove(&(s.start, unit));
            }
        }
        Ok(())
    }

    /// The pack hook: a [`Saved`] for a view of a shown parameter; otherwise the tensor, or
    /// for one of the graph (with a `grad_fn`) a detached alias of it. Saved as itself, an
    /// output its own node saves (a ReLU's, a softmax's) would refer to that node, which
    /// refers to it: a cycle through autograd's C++ that Python's collector cannot see, which
    /// kept every forward's graph and activations alive when no backward ran. Autograd gives
    /// the unpacked alias its place in the graph back.
    fn pack<'py>(&mut self, t: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let t0 = Instant::now();
        let found = if self.live.is_empty() { None } else { self.pack_inner(&t)? };
        let out = match found {
            Some(saved) => Bound::new(t.py(), saved)?.into_any(),
            None => detached(t)?,
        };
        self.nanos += t0.elapsed().as_nanos() as u64;
        Ok(out)
    }

    /// The unpack hook: the tensor a [`Saved`] stands for, anything else as it is.
    fn unpack<'py>(slf: &Bound<'py, Self>, x: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let Ok(saved) = x.cast::<Saved>() else { return Ok(x) };
        let py = x.py();
        let t0 = Instant::now();
        let s = saved.get();
        let view = {
            let me = slf.borrow();
            let p = s.pid as usize;
            let ready = me.backward && me.shown[me.owner[p] as usize];
            ready.then(|| me.views[p].as_ref().map(|v| v.clone_ref(py))).flatten()
        };
        let Some(view) = view else {
            // Python fetches the unit (beginning the backward first if need be). Not borrowed
            // during the callback: the fetch shows the unit's spans.
            let call = slf.borrow().unpack_saved.as_ref().map(|c| c.clone_ref(py));
            let Some(call) = call else {
                return Err(crate::errors::other(
                    "hooks: a saved tensor unpacked after its sharded model was freed (the backward of a \
                     graph that outlived the model)",
                ));
            };
            return call.bind(py).call1((x,));
        };
        let mut base = view.into_bound(py);
        if !base.getattr(intern!(py, "dtype"))?.eq(s.dtype.bind(py))? {
            base = base.call_method1(intern!(py, "view"), (s.dtype.bind(py),))?;
        }
        let out =
            base.call_method1(intern!(py, "as_strided"), (s.size.bind(py), s.stride.bind(py), s.offset))?;
        slf.borrow_mut().nanos += t0.elapsed().as_nanos() as u64;
        Ok(out)
    }

    /// Whether the backward has begun (set by Python as it begins and ends).
    #[setter]
    fn set_backward(&mut self, on: bool) {
        self.backward = on;
    }

    /// The time spent in the hooks since the last call, in seconds (callbacks excluded).
    fn take_seconds(&mut self) -> f64 {
        std::mem::take(&mut self.nanos) as f64 * 1e-9
    }
}
