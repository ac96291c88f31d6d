//! Run-time split sizes: for random 1-d to 3-d meshes, a split dim on one axis with random
//! per-rank sizes (empty parts included) and the other axes B or splitting other dims, the
//! ranks' regions tile the global index space exactly once after identifying B copies; with
//! the balanced splitter's sizes the regions are the layout's own; layouts the sizes do not fit
//! are refused with messages naming the axis and the layout.

use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{BalancedSplitter, GlobalLayout, NdSbp, RuntimeSplit, Sbp, SbpError};
use proptest::prelude::*;

fn layout(mesh: &[usize], dims: &[usize], nd: Vec<Sbp>) -> GlobalLayout {
    let n: usize = mesh.iter().product();
    let p = Placement::new(DeviceType::Cpu, mesh.to_vec(), (0..n).collect::<Vec<_>>()).unwrap();
    GlobalLayout::new(dims.to_vec(), &p, NdSbp::new(nd)).unwrap()
}

/// Cells of the index space covered by `split`'s regions, counting each B copy once.
fn coverage(split: &RuntimeSplit) -> Vec<usize> {
    let l = split.layout();
    let dims = l.shape().dims().to_vec();
    let mut count = vec![0usize; dims.iter().product()];
    let p = l.placement();
    for idx in 0..p.num_ranks() {
        let coord = p.coord_of_index(idx);
        let copy = l
            .nd_sbp()
            .iter()
            .zip(&coord)
            .any(|(s, &c)| s == Sbp::B && c != 0);
        if copy {
            continue;
        }
        let region = split.region_at(&coord);
        let cells: Vec<Vec<usize>> = region.iter().map(|r| r.clone().collect()).collect();
        let mut at = vec![0usize; dims.len()];
        'cells: loop {
            if cells.iter().any(|c| c.is_empty()) {
                break;
            }
            let flat = (0..dims.len()).fold(0, |f, d| f * dims[d] + cells[d][at[d]]);
            count[flat] += 1;
            for d in (0..dims.len()).rev() {
                at[d] += 1;
                if at[d] < cells[d].len() {
                    continue 'cells;
                }
                at[d] = 0;
            }
            break;
        }
    }
    count
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn regions_tile_with_runtime_sizes(
        mesh in (1usize..=3).prop_flat_map(|a| proptest::collection::vec(1usize..=3, a)),
        sizes_seed in proptest::collection::vec(0usize..=4, 3),
        other in 0usize..=4,
        axis_pick in 0usize..3,
        pick in proptest::collection::vec(0usize..3, 3),
    ) {
        let axis = axis_pick % mesh.len();
        let sizes: Vec<usize> = sizes_seed[..mesh[axis]].to_vec();
        let dims = vec![sizes.iter().sum::<usize>(), other];
        let nd: Vec<Sbp> = (0..mesh.len())
            .map(|a| if a == axis { Sbp::S(0) } else if pick[a] == 0 { Sbp::B } else { Sbp::S(1) })
            .collect();
        let l = layout(&mesh, &dims, nd);
        let split = RuntimeSplit::new(&l, axis, sizes.clone()).unwrap();
        prop_assert!(coverage(&split).iter().all(|&c| c == 1), "{l} with sizes {sizes:?}");
        for idx in 0..l.placement().num_ranks() {
            let coord = l.placement().coord_of_index(idx);
            prop_assert_eq!(split.local_shape_at(&coord).dim(0), sizes[coord[axis]]);
        }
        let balanced = BalancedSplitter::new(dims[0], mesh[axis]).sizes();
        let even = RuntimeSplit::new(&l, axis, balanced).unwrap();
        for idx in 0..l.placement().num_ranks() {
            let coord = l.placement().coord_of_index(idx);
            prop_assert_eq!(even.region_at(&coord), l.region_at(&coord));
        }
    }
}

#[test]
fn sizes_that_do_not_fit_are_refused() {
    let refused =
        |l: &GlobalLayout, axis: usize, sizes: Vec<usize>, want: &str| match RuntimeSplit::new(
            l, axis, sizes,
        ) {
            Err(e @ SbpError::RuntimeSplit { .. }) => {
                let text = e.to_string();
                assert!(text.contains(want), "{text}");
                assert!(text.contains(&format!("mesh axis {axis} of")), "{text}");
            }
            other => panic!("expected a refusal naming {want:?}, got {other:?}"),
        };
    let l = layout(&[2, 2], &[5, 3], vec![Sbp::B, Sbp::S(0)]);
    refused(&l, 0, vec![2, 3], "the axis is B, not a split");
    refused(&l, 2, vec![2, 3], "the layout has 2 mesh axes");
    refused(&l, 1, vec![2, 2], "do not add up to the 5 rows of dim 0");
    refused(&l, 1, vec![5], "1 sizes [5] for the 2 ranks along the axis");
    refused(&l, 1, vec![usize::MAX, 6], "do not add up");
    let nested = layout(&[2, 2], &[5, 3], vec![Sbp::S(0), Sbp::S(0)]);
    refused(&nested, 1, vec![2, 3], "mesh axis 0 splits dim 0 too");
    let ok = RuntimeSplit::new(&l, 1, vec![0, 5]).unwrap();
    assert_eq!(ok.region_at(&[1, 0]).to_vec(), vec![0..0, 0..3]);
    assert_eq!(ok.region_at(&[0, 1]).to_vec(), vec![0..5, 0..3]);
    assert_eq!((ok.axis(), ok.dim(), ok.sizes()), (1, 0, &[0, 5][..]));
}
