//! The parameter-file parser (with the optional `module` field) on arbitrary text, then the
//! module keys of whatever parsed: an error or a valid set, never a panic.
#![no_main]
libfuzzer_sys::fuzz_target!(|text: &str| {
    let _ = collsched_buckets::fuzz_parse_params(text);
});
