#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kt_core::fuzzing::routing(data));
