//! The parameter-file parser on arbitrary text: an error or a valid set, never a panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|text: &str| {
    let _ = collsched_buckets::ParamSet::from_json(text);
});
