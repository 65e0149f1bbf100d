//! `collsched._native`: the Python bindings of collsched, behind the `collsched` package
//! (`python/collsched/`). Plans (`plan::plan_json`), the collective bench (`bench::bench`), a
//! rank of the `shm` backend (`world::World`), a sharded model and its engines
//! (`model::Model`, `model::Engine`), and library memory exported to torch without copies
//! (`region::Region`, the crate's only `unsafe`), the saved-tensor hooks of a model's passes
//! (`hooks::Hooks`), and collectives on torch tensors for the
//! `"collsched"` torch.distributed backend (`comm::Comm`, `comm::Work`).

mod bench;
mod comm;
mod errors;
mod hooks;
mod model;
mod plan;
mod region;
mod world;

use pyo3::prelude::*;

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("CollschedError", py.get_type::<errors::CollschedError>())?;
    m.add("PeerError", py.get_type::<errors::PeerError>())?;
    m.add("MismatchError", py.get_type::<errors::MismatchError>())?;
    m.add_function(wrap_pyfunction!(plan::plan_json, m)?)?;
    m.add_function(wrap_pyfunction!(bench::bench, m)?)?;
    m.add_function(wrap_pyfunction!(world::flight_entries, m)?)?;
    m.add_function(wrap_pyfunction!(model::checkpoint_dir, m)?)?;
    m.add_class::<world::World>()?;
    m.add("HAS_MPI", world::HAS_MPI)?;
    m.add("HAS_CUDA", world::HAS_CUDA)?;
    m.add_class::<comm::Comm>()?;
    m.add_class::<comm::Work>()?;
    m.add_class::<comm::Block>()?;
    m.add_class::<model::Model>()?;
    m.add_class::<model::Engine>()?;
    m.add_class::<region::Region>()?;
    m.add_class::<hooks::Hooks>()?;
    m.add_class::<hooks::Saved>()?;
    Ok(())
}
