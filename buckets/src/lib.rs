//! Parameters, sharding strategies and coalescing buckets: *what* is moved together.
//!
//! No I/O, no threads, no clocks, no unsafe.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
