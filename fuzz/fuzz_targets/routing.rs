#![no_main]
static LAYERS: std::sync::LazyLock<kt_core::fuzzing::RoutingLayers> = std::sync::LazyLock::new(Default::default);
libfuzzer_sys::fuzz_target!(|data: &[u8]| kt_core::fuzzing::routing(&LAYERS, data));
