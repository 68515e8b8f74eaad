//! # kt-x86
//!
//! What the x86 backends share, so that no backend crate depends on another: run-time ISA
//! detection (with the AMX tile permission Linux wants first) and the AMX tile seam (the
//! hardware tiles, the scalar emulator and the floor, configured and released here), and the
//! small vector pieces every backend's kernels call: KT's SwiGLU, software prefetch, the VNNI
//! `vpdpbusd` encodings, the int4 nibble coding, row slices copied out to several buffers, the
//! walk that cuts a task's rows into a kernel's panels, and weight buffers in per-thread
//! huge-page arenas.
//!
//! **Must not** hold a backend's kernels, packing or activation layouts (those live in the
//! backend crates; the SFT kernels in `kt-x86-sft`, the instruction peaks in `kt-peak`), nor
//! depend on a backend crate or on the host.

#[cfg(target_arch = "x86_64")]
pub mod amx;
pub mod copy;
pub mod int4;
#[cfg(target_arch = "x86_64")]
pub mod isa;
pub mod memory;
pub mod panels;
#[cfg(target_arch = "x86_64")]
pub mod prefetch;
#[cfg(target_arch = "x86_64")]
pub mod swiglu;
#[cfg(target_arch = "x86_64")]
pub mod vnni;
