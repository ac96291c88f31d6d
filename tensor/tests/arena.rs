//! Host arenas: kernels run into pieces placed at offsets of one arena give the bits of the
//! same kernels into allocated pieces (f64, f32, bf16 computed through f32, matrix products,
//! multi-output ops), over bytes left dirty by earlier pieces; views and copies of placed
//! pieces; and what does not fit (a misaligned or overflowing offset, a view of another size,
//! a copy of another shape) is a typed error.

mod common;

use std::sync::Arc;

use oxiflow_tensor::arena::{run_kernel_into, Arena, ARENA_ALIGN};
use oxiflow_tensor::capture::{piece_of, run_local_kernel, tensor_from_piece};
use oxiflow_tensor::{
    BinaryOp, DType, Device, ElementwiseOp, MatmulOp, MatmulPrecision, MatmulProduct, Op, OutSpec,
    Shape, SoftmaxOp, Storage, Tensor, UnaryOp,
};

fn piece(t: &Tensor) -> Arc<Storage> {
    piece_of(t).unwrap().clone()
}

/// The bits of a piece's values, each widened to f64.
fn bits(s: &Storage) -> Vec<u64> {
    common::bits(&tensor_from_piece(Some(Arc::new(s.clone())), None, s.dtype()).unwrap())
}

fn spec(shape: &[usize], dtype: DType) -> OutSpec {
    OutSpec {
        shape: Shape::from(shape),
        dtype,
    }
}

/// Runs `op` on `inputs` into allocated pieces and into pieces placed at `offset` of an arena
/// first filled with garbage, and compares the bits.
fn same_bits(op: Op, inputs: &[Tensor], outs: &[OutSpec]) {
    let pieces: Vec<Arc<Storage>> = inputs.iter().map(piece).collect();
    let refs: Vec<&Storage> = pieces.iter().map(|p| &**p).collect();
    let want = run_local_kernel(&op, &refs, Device::Cpu, outs).unwrap();
    let arena = Arena::new(Device::Cpu, 1 << 16).unwrap();
    // Dirty bytes where the outputs go.
    let mut junk = arena.place(0, &spec(&[(1 << 16) / 8], DType::F64)).unwrap();
    junk.write_from(&piece(&Tensor::randn([(1 << 16) / 8], 9, DType::F64)))
        .unwrap();
    drop(junk);
    let mut offset = ARENA_ALIGN;
    let mut placed = Vec::new();
    for o in outs {
        placed.push(arena.place(offset, o).unwrap());
        let bytes = o.shape.numel() * o.dtype.size();
        offset += bytes.div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
    }
    run_kernel_into(&op, &refs, Device::Cpu, &mut placed).unwrap();
    for (w, p) in want.iter().zip(&placed) {
        assert_eq!(bits(w), bits(p.storage().unwrap()), "{op:?}");
        assert_eq!(bits(w), bits(&p.to_owned_storage().unwrap()), "{op:?}");
    }
}

#[test]
fn kernels_into_placed_pieces_give_the_allocated_bits() {
    let a = Tensor::randn([7, 5], 1, DType::F64);
    let b = Tensor::randn([7, 5], 2, DType::F64);
    let w = Tensor::randn([5, 3], 3, DType::F64);
    same_bits(
        Op::Elementwise(ElementwiseOp::Binary(BinaryOp::Add)),
        &[a.clone(), b.clone()],
        &[spec(&[7, 5], DType::F64)],
    );
    same_bits(
        Op::Elementwise(ElementwiseOp::Unary(UnaryOp::Gelu)),
        std::slice::from_ref(&a),
        &[spec(&[7, 5], DType::F64)],
    );
    same_bits(
        Op::Matmul(MatmulOp::new(MatmulProduct::MatMul, MatmulPrecision::F32)),
        &[a.clone(), w],
        &[spec(&[7, 3], DType::F64)],
    );
    same_bits(
        Op::Softmax(SoftmaxOp::Forward { dim: 1, log: true }),
        &[a.cast(DType::F32).unwrap()],
        &[spec(&[7, 5], DType::F32)],
    );
    // 16-bit: computed in f32, rounded once into the placed piece.
    let h = a.cast(DType::BF16).unwrap();
    same_bits(
        Op::Elementwise(ElementwiseOp::Binary(BinaryOp::Mul)),
        &[h.clone(), b.cast(DType::BF16).unwrap()],
        &[spec(&[7, 5], DType::BF16)],
    );
    same_bits(
        Op::Elementwise(ElementwiseOp::Cast(DType::F32)),
        &[h],
        &[spec(&[7, 5], DType::F32)],
    );
}

#[test]
fn placed_pieces_view_copy_and_refuse_what_does_not_fit() {
    let arena = Arena::new(Device::Cpu, 4 * ARENA_ALIGN).unwrap();
    assert_eq!(arena.bytes(), 4 * ARENA_ALIGN);
    assert_eq!(arena.host_address() % ARENA_ALIGN, 0);
    let x = Tensor::randn([4, 6], 5, DType::F64);
    let mut p = arena
        .place(ARENA_ALIGN, &spec(&[4, 6], DType::F64))
        .unwrap();
    p.write_from(&piece(&x)).unwrap();
    assert_eq!(bits(p.storage().unwrap()), bits(&piece(&x)));
    let v = p.view_at(0, &spec(&[24], DType::F64)).unwrap();
    assert_eq!(bits(v.storage().unwrap()), bits(&piece(&x)));
    assert_eq!(v.offset(), ARENA_ALIGN);
    // A run of elements from the middle: elements 7..17 of the piece, at an offset that is
    // no multiple of the arena's alignment.
    let run = p.view_at(7 * 8, &spec(&[2, 5], DType::F64)).unwrap();
    assert_eq!(run.offset(), ARENA_ALIGN + 56);
    let flat = piece(&x.reshape([24]).unwrap().narrow(0, 7, 10).unwrap());
    assert_eq!(bits(run.storage().unwrap()), bits(&flat));
    // A zero-size piece anywhere inside, even at the end.
    arena
        .place(4 * ARENA_ALIGN, &spec(&[0, 3], DType::F32))
        .unwrap();
    refused(
        arena.place(8, &spec(&[2], DType::F64)),
        "at offset 8 does not fit",
    );
    refused(
        arena.place(3 * ARENA_ALIGN, &spec(&[33], DType::F64)),
        "(264 bytes) at offset 768",
    );
    refused(
        arena.place(usize::MAX - 255, &spec(&[1], DType::F64)),
        "does not fit",
    );
    refused(
        p.view_at(0, &spec(&[25], DType::F64)),
        "cannot view f64 [4, 6] from byte 0 as f64 [25]",
    );
    refused(
        p.view_at(8, &spec(&[24], DType::F64)),
        "from byte 8 as f64 [24]",
    );
    refused(p.view_at(4, &spec(&[2], DType::F64)), "from byte 4");
    refused(
        p.view_at(usize::MAX - 7, &spec(&[1], DType::F64)),
        "cannot view",
    );
    refused(p.view_at(0, &spec(&[24], DType::F32)), "cannot view");
    refused(
        p.write_from(&piece(&Tensor::randn([6, 4], 1, DType::F64))),
        "[6, 4] into [4, 6]",
    );
    refused(
        p.write_from(&piece(&Tensor::randn([4, 6], 1, DType::F32))),
        "dtypes differ",
    );
    // A device arena needs the device's backend.
    refused(
        Arena::new(Device::Cuda(0), 1024),
        "no backend registered for cuda:0",
    );
}

/// Asserts that `r` is an error whose message contains `want`.
fn refused<T>(r: oxiflow_tensor::Result<T>, want: &str) {
    match r {
        Err(e) => {
            let e = e.to_string();
            assert!(e.contains(want), "{e}");
        }
        Ok(_) => panic!("accepted"),
    }
}
