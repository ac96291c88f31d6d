//! Layouts: for random shapes (dims smaller than the rank count and zero-size dims included),
//! 1-d to 3-d meshes and random nd-SBPs, the ranks' regions tile the global index space exactly
//! once after identifying B copies and P components, local shapes follow the balanced splitter,
//! and materialising pieces then reassembling them gives the whole value back.

mod reference;

use oxiflow_placement::{DeviceType, Placement};
use oxiflow_sbp::{BalancedSplitter, GlobalLayout, NdSbp, Sbp, Shape};
use proptest::prelude::*;
use reference::{materialise, nd_of, reassemble, Arr};

fn mesh_strategy() -> impl Strategy<Value = Vec<usize>> {
    (1usize..=3).prop_flat_map(|axes| proptest::collection::vec(1usize..=4, axes))
}

/// Local size of dim `d` at `coord`, from part sizes alone: each axis that splits d takes its
/// part of what the earlier axes left.
fn expected_local_dim(n: usize, d: usize, mesh: &[usize], nd: &NdSbp, coord: &[usize]) -> usize {
    nd.iter().enumerate().fold(n, |n, (a, s)| {
        if s == Sbp::S(d) {
            BalancedSplitter::new(n, mesh[a]).size(coord[a])
        } else {
            n
        }
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn regions_tile_the_index_space(
        dims in proptest::collection::vec(0usize..=5, 0..=4),
        mesh in mesh_strategy(),
        pick in proptest::collection::vec(0usize..100, 3),
        gap in 0usize..3,
    ) {
        let n: usize = mesh.iter().product();
        // Ranks in a scrambled order, leaving out some rank numbers, so ranks and mesh
        // positions differ.
        let ranks: Vec<usize> = (0..n).map(|i| (i * 5 + gap) % n * 2 + gap).collect();
        let placement = Placement::new(DeviceType::Cuda, mesh.clone(), ranks.clone()).unwrap();
        let shape = Shape::from(dims.clone());
        let nd = nd_of(dims.len(), &pick[..mesh.len()]);
        let layout = GlobalLayout::new(shape.clone(), &placement, nd.clone()).unwrap();

        // Representatives: coordinate 0 on every B and P axis. Every other rank repeats the
        // region of the representative with its S coordinates.
        let mut count = vec![0u32; shape.numel()];
        let strides = shape.strides();
        for (idx, &rank) in ranks.iter().enumerate() {
            let coord = placement.coord_of_index(idx);
            let region = layout.region_of(rank).unwrap();
            prop_assert_eq!(&region, &layout.region_at(&coord));
            let local = layout.local_shape(rank).unwrap();
            for (d, &len) in dims.iter().enumerate() {
                prop_assert_eq!(local.dim(d), expected_local_dim(len, d, &mesh, &nd, &coord));
                prop_assert_eq!(region[d].len(), local.dim(d));
                prop_assert!(region[d].end <= len);
            }
            let rep: Vec<usize> = coord
                .iter()
                .enumerate()
                .map(|(a, &c)| if nd[a].is_split() { c } else { 0 })
                .collect();
            if rep != coord {
                prop_assert_eq!(&region, &layout.region_at(&rep), "B copy / P component differs");
                continue;
            }
            let local_n: usize = region.iter().map(|r| r.len()).product();
            for f in 0..local_n {
                let mut rem = f;
                let mut off = 0;
                for d in (0..dims.len()).rev() {
                    let len = region[d].len();
                    off += (region[d].start + rem % len) * strides[d];
                    rem /= len;
                }
                count[off] += 1;
            }
        }
        prop_assert!(count.iter().all(|&c| c == 1), "coverage counts {:?} for {} over {:?}", count, nd, mesh);
        // Ranks outside the placement hold nothing.
        prop_assert_eq!(layout.region_of(2 * n + 7), None);
        prop_assert_eq!(layout.local_shape(2 * n + 7), None);

        // The reference interpreter's pieces are these regions, and they reassemble to the whole.
        let whole = Arr::random(&dims, pick[0] as u64, -2.0, 2.0);
        let pieces = materialise(&whole, &mesh, &nd, 11);
        for (idx, piece) in pieces.iter().enumerate() {
            let coord = placement.coord_of_index(idx);
            prop_assert_eq!(&piece.shape, &layout.local_shape_at(&coord).to_vec());
            if !nd.has_partial() {
                prop_assert_eq!(piece, &whole.region(&layout.region_at(&coord)));
            }
        }
        let back = reassemble(&pieces, &mesh, &nd).unwrap();
        prop_assert!(reference::close(&back, &whole), "{:?} vs {:?}", back, whole);
    }
}
