//! `plan_json`: the plan of a parameter list, as `collsched plan --json` prints it (both write
//! `Plan::json`, the schedule crate's plan JSON).

use collsched::buckets::{Boundary, Sharding};
use collsched::schedule::{plan_from_json, Plan, PlanInputError};
use pyo3::prelude::*;

use crate::errors;

/// Builds the plan of `params` (the parameter file's JSON text) for `world` ranks.
pub fn build(
    params: &str,
    world: u32,
    strategy: &str,
    bucket_mb: f64,
    align: usize,
    bucket_by: &str,
) -> PyResult<Plan> {
    let sharding: Sharding =
        strategy.parse().map_err(|e| errors::other(format!("strategy {strategy:?}: {e}")))?;
    let boundary: Boundary =
        bucket_by.parse().map_err(|e| errors::other(format!("bucket_by {bucket_by:?}: {e}")))?;
    let bytes = collsched::cli::plan::bucket_bytes(bucket_mb)
        .map_err(|e| errors::other(e.to_string().replace("--bucket-mb", "bucket_mb")))?;
    plan_from_json(params, sharding, world, bytes, align, boundary).map_err(|e| match e {
        PlanInputError::Params(e) => errors::other(format!("parameters: {e}")),
        PlanInputError::Layout(e) => errors::other(e),
    })
}

/// The plan JSON (`collsched plan --json`'s format) of `params`, a parameter file's text
/// (`{"params": [{"name", "shape", "dtype", "trainable", "module"}, ...]}`).
#[pyfunction]
#[pyo3(signature = (params, world, strategy="even", bucket_mb=64.0, align=collsched::buckets::DEFAULT_ALIGN, bucket_by="size"))]
pub fn plan_json(
    params: &str,
    world: u32,
    strategy: &str,
    bucket_mb: f64,
    align: usize,
    bucket_by: &str,
) -> PyResult<String> {
    let plan = build(params, world, strategy, bucket_mb, align, bucket_by)?;
    json(&plan)
}

/// A plan as its JSON text ([`Plan::json`], the object `collsched plan --json` prints).
pub fn json(plan: &Plan) -> PyResult<String> {
    serde_json::to_string(&plan.json()).map_err(errors::other)
}
