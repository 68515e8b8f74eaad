//! `Scratch`: the buffers a layer's forward (and an SFT layer's forward and backward) work in
//! between its inputs and its outputs, and the cache an SFT forward fills but does not keep. Every call writes what it reads, so the layers of a
//! model, which run one at a time on one pool, share one: it holds the largest call's scratch
//! once, not once per layer.

use std::sync::{Arc, Mutex, MutexGuard};

use kt_core::{forward, sft};

/// One model's scratch, shared by its layers (see [`crate::LayerOptions::scratch`]).
#[derive(Debug, Default)]
pub struct Scratch {
    /// The inference forward's.
    pub forward: forward::Workspace,
    /// The SFT forward's and backward's.
    pub sft: sft::Workspace,
    /// What an SFT forward not saved for the backward fills (SGLang's LoRA serving): a forward
    /// fills a cache whether or not it is kept.
    pub unsaved: sft::Cache,
}

impl Scratch {
    /// Bytes its buffers hold.
    pub fn bytes(&self) -> usize {
        self.forward.bytes() + self.sft.bytes() + self.unsaved.bytes()
    }
}

/// A handle that layers clone to share one [`Scratch`].
pub type SharedScratch = Arc<Mutex<Scratch>>;

/// The scratch, locked; a lock a panicking call poisoned is taken anyway, since every call
/// writes what it reads.
pub fn lock(s: &SharedScratch) -> MutexGuard<'_, Scratch> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}
