//! Memory planning: every buffer the program writes gets a fixed offset in one arena per
//! rank, so that buffers whose lifetimes share a node never share bytes and a dead buffer's
//! bytes are reused. Greedy by size (largest first, then first written), each at the lowest
//! aligned offset clear of the buffers already placed that it overlaps in time. Offsets are a
//! pure function of the program, so every replay (and a CUDA graph captured from one) sees the
//! same addresses.

use crate::ir::ValueId;
use crate::passes::liveness::{BufferLife, Liveness};

/// Alignment of every offset (what device kernels and vector loads want): the arenas'.
pub use oxiflow_tensor::arena::ARENA_ALIGN;

/// One buffer's place in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub life: BufferLife,
    pub offset: usize,
}

impl Placed {
    /// One past the buffer's last byte.
    pub fn end(&self) -> usize {
        self.offset + self.life.bytes
    }
}

/// The arena of one rank's program.
#[derive(Clone, Debug, Default)]
pub struct ArenaPlan {
    /// Every buffer with its offset, in order of first write.
    pub placed: Vec<Placed>,
    /// Bytes of the arena (the highest end of any buffer, aligned).
    pub bytes: usize,
}

fn align_up(n: usize) -> usize {
    n.div_ceil(ARENA_ALIGN) * ARENA_ALIGN
}

/// Places every buffer of `live` (see the module docs).
pub fn plan_arena(live: &Liveness) -> ArenaPlan {
    let mut order: Vec<&BufferLife> = live.buffers.iter().collect();
    order.sort_by(|a, b| {
        b.bytes
            .cmp(&a.bytes)
            .then(a.def.cmp(&b.def))
            .then(a.buffer.cmp(&b.buffer))
    });
    // Kept sorted by offset, so the buffers a new one clashes with come in offset order.
    let mut placed: Vec<Placed> = Vec::with_capacity(order.len());
    for life in order {
        let mut offset = 0;
        for p in placed.iter().filter(|p| p.life.overlaps(life)) {
            if offset + life.bytes <= p.offset {
                break;
            }
            offset = offset.max(align_up(p.end()));
        }
        let at = placed.partition_point(|p| p.offset <= offset);
        placed.insert(
            at,
            Placed {
                life: *life,
                offset,
            },
        );
    }
    placed.sort_by_key(|p| (p.life.def, p.life.buffer));
    let bytes = placed.iter().map(|p| align_up(p.end())).max().unwrap_or(0);
    ArenaPlan { placed, bytes }
}

impl ArenaPlan {
    /// The offset of a buffer.
    pub fn offset_of(&self, buffer: ValueId) -> Option<usize> {
        self.placed
            .iter()
            .find(|p| p.life.buffer == buffer)
            .map(|p| p.offset)
    }

    /// Two buffers that overlap in time and in bytes (none in a correct plan), or a buffer
    /// past the arena or off the alignment.
    pub fn first_conflict(&self) -> Option<String> {
        for (i, a) in self.placed.iter().enumerate() {
            if a.offset % ARENA_ALIGN != 0 || a.end() > self.bytes {
                return Some(format!(
                    "{} at {} does not fit the arena",
                    a.life.buffer, a.offset
                ));
            }
            for b in &self.placed[i + 1..] {
                let bytes_overlap = a.life.bytes > 0
                    && b.life.bytes > 0
                    && a.offset < b.end()
                    && b.offset < a.end();
                if bytes_overlap && a.life.overlaps(&b.life) {
                    return Some(format!(
                        "{} [{}, {}) and {} [{}, {}) are live together",
                        a.life.buffer,
                        a.offset,
                        a.end(),
                        b.life.buffer,
                        b.offset,
                        b.end()
                    ));
                }
            }
        }
        None
    }
}
