#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| kt_host::gguf::fuzzing::fuzz(data));
