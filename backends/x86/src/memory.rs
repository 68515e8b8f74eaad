//! Buffers for packed weights, carved from per-thread arenas of huge pages.
//!
//! Decode streams every routed expert's matrices from DRAM, and on 4 KiB pages each page costs a
//! TLB walk (two-dimensional in a VM) and stops the hardware prefetchers. A transparent huge
//! page needs a whole 2 MiB-aligned, `MADV_HUGEPAGE` range, which a matrix of its own rarely
//! gives: qwen3-30b-a3b's expert matrices are 0.75-3 MiB, so an allocation per matrix got no
//! huge page at all in int8 or int4 and one in three of its bytes in bf16. Here a thread's
//! matrices are laid one after another in 64 MiB chunks advised once, so all but a chunk's
//! unfilled tail sits on huge pages (where the kernel has them: a no-op where transparent huge
//! pages are off).

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::cell::RefCell;
use std::ptr::NonNull;
use std::sync::{Arc, Weak};

/// A transparent huge page of x86-64.
const HUGE: usize = 2 << 20;

/// Address space of one chunk. Pages are faulted in only where a buffer is written, so an
/// unfilled tail costs addresses, not memory.
const CHUNK: usize = 64 << 20;

/// Buffers below this size get an allocation of their own: a chunk's first huge page would
/// outweigh them (tests, tiny shapes).
const SMALL: usize = 64 << 10;

/// Buffers start at multiples of this inside a chunk.
const START: usize = 4096;

/// One allocation that buffers are carved from; freed with the last of them.
struct Chunk {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a chunk is plain memory; its buffers hand out disjoint ranges of it (`WeightBuf`).
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

impl Chunk {
    /// `len` bytes aligned to `align`, advised for huge pages where `huge`; not yet touched.
    fn new(len: usize, align: usize, huge: bool) -> Arc<Chunk> {
        let layout =
            Layout::from_size_align(len.max(1), align).unwrap_or_else(|_| handle_alloc_error(Layout::new::<u8>()));
        // SAFETY: the layout has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc(layout) }).unwrap_or_else(|| handle_alloc_error(layout));
        #[cfg(target_os = "linux")]
        if huge {
            // SAFETY: the range is this allocation; madvise only sets a hint.
            unsafe { libc::madvise(ptr.as_ptr().cast(), len, libc::MADV_HUGEPAGE) };
        }
        #[cfg(not(target_os = "linux"))]
        let _ = huge;
        Arc::new(Chunk { ptr, layout })
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // SAFETY: allocated in `Chunk::new` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

thread_local! {
    /// This thread's current chunk and the bytes of it handed out. Each thread fills its own,
    /// so a buffer's pages are first touched, and placed, on the NUMA node of the thread that
    /// packed it: the layer's packing runs each part on the sub-pool that computes with it.
    /// Held weakly: a chunk whose buffers are all dropped is freed, not kept for the next.
    static ARENA: RefCell<(Weak<Chunk>, usize)> = const { RefCell::new((Weak::new(), 0)) };
}

/// A zeroed buffer of packed weights, 64-byte aligned ([`weight_buffer`]).
pub struct WeightBuf {
    chunk: Arc<Chunk>,
    offset: usize,
    len: usize,
}

impl WeightBuf {
    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// `true` when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: offset + len lies inside the chunk, which this buffer keeps alive, and was
        // zeroed (so initialised) when the buffer was made.
        unsafe { std::slice::from_raw_parts(self.chunk.ptr.as_ptr().add(self.offset), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`; no other buffer covers these bytes and `&mut self` is unique.
        unsafe { std::slice::from_raw_parts_mut(self.chunk.ptr.as_ptr().add(self.offset), self.len) }
    }

    /// A buffer holding a copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> WeightBuf {
        let mut b = weight_buffer(bytes.len());
        b.as_mut_slice().copy_from_slice(bytes);
        b
    }

    /// Whether `self` and `other` were carved from the same chunk.
    #[cfg(test)]
    fn shares_chunk(&self, other: &WeightBuf) -> bool {
        Arc::ptr_eq(&self.chunk, &other.chunk)
    }
}

impl std::ops::Deref for WeightBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for WeightBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl std::fmt::Debug for WeightBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "WeightBuf({} bytes)", self.len)
    }
}

/// A zeroed buffer for `len` bytes of packed weights: from this thread's chunk (a new one when
/// it is full), or on its own where it is small or over half a chunk (then 2 MiB-aligned and
/// advised itself). Zeroed here, so its pages are first touched by the calling thread.
pub fn weight_buffer(len: usize) -> WeightBuf {
    let (chunk, offset) = if len < SMALL {
        (Chunk::new(len, 64, false), 0)
    } else if len > CHUNK / 2 {
        (Chunk::new(len, HUGE, true), 0)
    } else {
        ARENA.with(|arena| {
            let mut arena = arena.borrow_mut();
            let at = arena.1.next_multiple_of(START);
            match arena.0.upgrade() {
                Some(c) if at + len <= c.layout.size() => {
                    arena.1 = at + len;
                    (c, at)
                }
                _ => {
                    let c = Chunk::new(CHUNK, HUGE, true);
                    *arena = (Arc::downgrade(&c), len);
                    (c, 0)
                }
            }
        })
    };
    let mut b = WeightBuf { chunk, offset, len };
    b.as_mut_slice().fill(0);
    b
}

/// Where the kernel says whether it backs advised ranges with transparent huge pages.
pub const THP_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// The transparent-huge-page mode (`always`, `madvise` or `never`), or `None` where the kernel
/// has none (not Linux, or built without them): the arenas' advice takes effect under the
/// first two.
pub fn huge_page_mode() -> Option<String> {
    selected_mode(&std::fs::read_to_string(THP_ENABLED).ok()?).map(str::to_owned)
}

/// The bracketed word of a sysfs choice list such as `always [madvise] never`.
fn selected_mode(list: &str) -> Option<&str> {
    list.split_whitespace().find_map(|w| w.strip_prefix('[')?.strip_suffix(']'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_selected_mode_is_the_bracketed_one() {
        assert_eq!(selected_mode("always [madvise] never\n"), Some("madvise"));
        assert_eq!(selected_mode("[always] madvise never"), Some("always"));
        assert_eq!(selected_mode("always madvise [never]"), Some("never"));
        assert_eq!(selected_mode("always madvise never"), None);
    }

    #[test]
    fn buffers_are_zeroed_aligned_and_disjoint() {
        let sizes = [0, 1, SMALL - 1, SMALL, 1 << 20, 3 << 20, CHUNK / 2 + 1];
        let mut bufs: Vec<WeightBuf> = sizes.iter().map(|&n| weight_buffer(n)).collect();
        for (b, &n) in bufs.iter().zip(&sizes) {
            assert_eq!(b.len(), n);
            assert_eq!(b.as_ptr() as usize % 64, 0, "{n} bytes");
            assert!(b.iter().all(|&x| x == 0), "{n} bytes not zeroed");
        }
        for (i, b) in bufs.iter_mut().enumerate() {
            b.fill(i as u8 + 1);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(b.iter().all(|&x| x == i as u8 + 1), "buffer {i} was written by another");
        }
        assert_eq!(WeightBuf::copy_of(&[1, 2, 3]).as_slice(), &[1, 2, 3]);
    }

    #[test]
    fn a_thread_fills_one_chunk_and_threads_do_not_share() {
        let a = weight_buffer(1 << 20);
        let b = weight_buffer(3 << 20);
        assert!(a.shares_chunk(&b), "one thread's buffers go into its chunk");
        assert!(!a.shares_chunk(&weight_buffer(SMALL - 1)), "small buffers stand alone");
        assert!(!a.shares_chunk(&weight_buffer(CHUNK / 2 + 1)), "large buffers stand alone");
        let other = std::thread::spawn(|| weight_buffer(1 << 20)).join().unwrap();
        assert!(!a.shares_chunk(&other), "another thread (maybe another node) fills its own chunk");
        // A full chunk is followed by a new one.
        let fill: Vec<WeightBuf> = (0..CHUNK / (8 << 20)).map(|_| weight_buffer(8 << 20)).collect();
        assert!(!a.shares_chunk(fill.last().unwrap()));
    }

    #[test]
    fn a_chunk_is_freed_with_its_last_buffer() {
        let a = weight_buffer(1 << 20);
        let weak = Arc::downgrade(&a.chunk);
        let b = weight_buffer(1 << 20);
        drop(a);
        assert!(weak.upgrade().is_some(), "b still holds the chunk");
        drop(b);
        assert!(weak.upgrade().is_none(), "the chunk outlived its buffers");
        assert_eq!(weight_buffer(1 << 20).chunk.layout.size(), CHUNK, "a new chunk serves the next");
    }

    /// The point of the arena: the chunk's whole range is advised (`hg` in smaps' VmFlags), so
    /// the kernel may back it with huge pages.
    #[cfg(target_os = "linux")]
    #[test]
    fn chunks_are_advised_for_huge_pages() {
        if !std::path::Path::new(THP_ENABLED).exists() {
            eprintln!("skipped: this kernel has no transparent huge pages to advise");
            return;
        }
        let b = weight_buffer(1 << 20);
        let start = b.chunk.ptr.as_ptr() as usize;
        assert_eq!(start % HUGE, 0);
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("/proc/self/smaps");
        // Each mapping's header line "lo-hi perms ..." then fields, then "VmFlags: ...".
        let mut covered = 0;
        let mut range = (0, 0);
        for line in smaps.lines() {
            if let Some((lo, hi)) = line.split_whitespace().next().and_then(|r| r.split_once('-')) {
                if let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) {
                    range = (lo, hi);
                    continue;
                }
            }
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                let (lo, hi) = (range.0.max(start), range.1.min(start + CHUNK));
                if lo < hi && flags.split_whitespace().any(|f| f == "hg") {
                    covered += hi - lo;
                }
            }
        }
        assert_eq!(covered, CHUNK, "the chunk at {start:#x} is not advised for huge pages throughout");
    }
}
