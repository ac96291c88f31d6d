//! bf16 and f16 checkpoints: safetensors pieces of dtype BF16/F16 (named through the dtype
//! table), loaded back bit for bit in any layout (saved split unevenly over 3 ranks, loaded
//! whole, over a [2, 2] mesh and on 2 ranks), with the integrity checks still refusing a
//! target of another dtype.

use std::path::PathBuf;
use std::time::Duration;

use oxiflow::checkpoint::{self, Metadata};
use oxiflow::{bf16, f16, run_ranks, DType, NdSbp, Placement, Sbp, Tensor, TensorElement};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("oxiflow-half-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Values that need every bit of a 16-bit float (the f32 randn values rounded once).
fn value(dtype: DType) -> Tensor {
    Tensor::randn([7, 6], 17, dtype)
}

/// The bits of a tensor's 16-bit values.
fn bits(t: &Tensor) -> Vec<u16> {
    fn of<H: TensorElement>(t: &Tensor, to_bits: fn(H) -> u16) -> Vec<u16> {
        t.to_vec::<H>().unwrap().into_iter().map(to_bits).collect()
    }
    match t.dtype() {
        DType::BF16 => of(t, bf16::to_bits),
        _ => of(t, f16::to_bits),
    }
}

#[test]
fn sixteen_bit_checkpoints_round_trip_exactly_across_layouts() {
    for dtype in [DType::BF16, DType::F16] {
        let p = dir(dtype.as_str());
        let want = bits(&value(dtype));
        // Saved as S(0) over 3 ranks: pieces of 3, 2 and 2 rows.
        run_ranks(3, Duration::from_secs(30), |_| {
            let pl = Placement::range(oxiflow::DeviceType::Cpu, 3).unwrap();
            let w = value(dtype).to_global(&pl, Sbp::B).unwrap();
            let w = w.to_global(&pl, Sbp::S(0)).unwrap();
            checkpoint::save_tensors(
                &p,
                &[("w".into(), w)],
                &Metadata::new(),
                &Default::default(),
            )
            .unwrap();
        });
        let manifest = checkpoint::read_manifest_at(&p).unwrap();
        assert_eq!(manifest.tensors["w"].dtype, dtype.as_str());
        assert_eq!(manifest.tensors["w"].pieces.len(), 3);
        // The safetensors header names the dtype as safetensors does.
        let file = std::fs::read_dir(&p)
            .unwrap()
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|f| f.extension().is_some_and(|x| x == "safetensors"))
            .expect("a safetensors piece");
        let raw = std::fs::read(&file).unwrap();
        let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
        let header = String::from_utf8_lossy(&raw[8..8 + n]).to_string();
        assert!(
            header.contains(&format!("\"dtype\":\"{}\"", dtype.safetensors_name())),
            "{header}"
        );
        // Whole, on one rank.
        let (t, _) =
            checkpoint::load_tensors(&p, &[("w".into(), Tensor::zeros([7, 6], dtype))]).unwrap();
        assert_eq!(bits(&t[0]), want);
        // On a [2, 2] mesh as (S(1), S(0)), and on 2 ranks as B.
        for (mesh, nd) in [
            (vec![2usize, 2], NdSbp::new([Sbp::S(1), Sbp::S(0)])),
            (vec![2], NdSbp::new([Sbp::B])),
        ] {
            let n: usize = mesh.iter().product();
            let got = run_ranks(n, Duration::from_secs(30), |_| {
                let pl = Placement::new(
                    oxiflow::DeviceType::Cpu,
                    mesh.clone(),
                    (0..n).collect::<Vec<_>>(),
                )
                .unwrap();
                let like = Tensor::zeros_global([7, 6], dtype, &pl, nd.clone()).unwrap();
                let (t, _) = checkpoint::load_tensors(&p, &[("w".into(), like)]).unwrap();
                assert_eq!(t[0].nd_sbp(), Some(&nd));
                bits(&t[0])
            });
            for g in got {
                assert_eq!(g, want, "{dtype} on {mesh:?} {nd}");
            }
        }
        // A target of another dtype is refused, naming both.
        let err = checkpoint::load_tensors(&p, &[("w".into(), Tensor::zeros([7, 6], DType::F32))])
            .unwrap_err();
        assert!(
            err.to_string().contains(dtype.as_str()) && err.to_string().contains("f32"),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&p);
    }
}
