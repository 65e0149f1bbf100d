//! Layout and plan building on arbitrary parameter files and knobs (bucket boundaries
//! included), then the copy lists: an error or a plan, never a panic or an overflow.
#![no_main]
libfuzzer_sys::fuzz_target!(|x: (&str, u8, u8, u32, u16, u8)| {
    let _ = collsched_schedule::plan::fuzz_build_plan(x.0, x.1, x.2, x.3, x.4, x.5);
});
