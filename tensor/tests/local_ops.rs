//! Local tensors: kernels against straightforward reference loops.

use ndarray::{array, ArrayD, IxDyn};
use oxiflow_tensor::{DType, Tensor, UnaryOp};

fn t(v: Vec<f32>, s: &[usize]) -> Tensor {
    Tensor::from_vec(v, s.to_vec()).unwrap()
}
fn close(a: &ArrayD<f32>, b: &ArrayD<f32>) {
    assert_eq!(a.shape(), b.shape());
    for (x, y) in a.iter().zip(b.iter()) {
        assert!((x - y).abs() <= 1e-4 * (1.0 + y.abs()), "{a} vs {b}");
    }
}

#[test]
fn matmul_and_bmm() {
    let a = t((0..6).map(|x| x as f32).collect(), &[2, 3]);
    let b = t((0..12).map(|x| x as f32).collect(), &[3, 4]);
    let c = a.matmul(&b).unwrap().to_ndarray::<f32>().unwrap();
    let av = a.to_ndarray::<f32>().unwrap();
    let bv = b.to_ndarray::<f32>().unwrap();
    for i in 0..2 {
        for j in 0..4 {
            let s: f32 = (0..3).map(|k| av[[i, k]] * bv[[k, j]]).sum();
            assert_eq!(c[[i, j]], s);
        }
    }
    let x = Tensor::randn([3, 2, 4], 1, DType::F32);
    let y = Tensor::randn([3, 4, 5], 2, DType::F32);
    let z = x.bmm(&y).unwrap().to_ndarray::<f32>().unwrap();
    assert_eq!(z.shape(), &[3, 2, 5]);
    let xv = x.to_ndarray::<f32>().unwrap();
    let yv = y.to_ndarray::<f32>().unwrap();
    let s: f32 = (0..4).map(|k| xv[[2, 1, k]] * yv[[2, k, 3]]).sum();
    assert!((z[[2, 1, 3]] - s).abs() < 1e-5);
    // Big enough for the rayon row-block path.
    let p = Tensor::randn([300, 200], 3, DType::F32);
    let q = Tensor::randn([200, 100], 4, DType::F32);
    let r = p.matmul(&q).unwrap().to_ndarray::<f32>().unwrap();
    let (pv, qv) = (
        p.to_ndarray::<f32>().unwrap(),
        q.to_ndarray::<f32>().unwrap(),
    );
    let s: f32 = (0..200).map(|k| pv[[299, k]] * qv[[k, 99]]).sum();
    assert!((r[[299, 99]] - s).abs() < 1e-3);
}

#[test]
fn broadcast_reduce_softmax() {
    let a = t(vec![1., 2., 3., 4., 5., 6.], &[2, 3]);
    let b = t(vec![10., 20., 30.], &[3]);
    let c = a.add(&b).unwrap().to_ndarray::<f32>().unwrap();
    close(&c, &array![[11., 22., 33.], [14., 25., 36.]].into_dyn());
    let s = a.sum(&[0], false).unwrap().to_ndarray::<f32>().unwrap();
    close(&s, &array![5., 7., 9.].into_dyn());
    let m = a.mean(&[-1], true).unwrap().to_ndarray::<f32>().unwrap();
    close(&m, &array![[2.], [5.]].into_dyn());
    let mx = a.max(&[1], false).unwrap().to_ndarray::<f32>().unwrap();
    close(&mx, &array![3., 6.].into_dyn());
    let sm = a.softmax(1).unwrap().to_ndarray::<f32>().unwrap();
    let e: Vec<f32> = [1f32, 2., 3.].iter().map(|x| x.exp()).collect();
    let z: f32 = e.iter().sum();
    assert!((sm[[0, 2]] - e[2] / z).abs() < 1e-6);
    let ls = a.log_softmax(1).unwrap().to_ndarray::<f32>().unwrap();
    assert!((ls[[1, 0]] - (e[0] / z).ln()).abs() < 1e-5);
    let g = a.sum_to_shape([3]).unwrap().to_ndarray::<f32>().unwrap();
    close(&g, &array![5., 7., 9.].into_dyn());
}

#[test]
fn layout_ops() {
    let a = t((0..24).map(|x| x as f32).collect(), &[2, 3, 4]);
    let p = a.permute(&[2, 0, 1]).unwrap();
    assert_eq!(p.shape().dims(), &[4, 2, 3]);
    let pv = p.to_ndarray::<f32>().unwrap();
    assert_eq!(pv[[3, 1, 2]], 1. * 12. + 2. * 4. + 3.);
    let r = a.reshape([6, 4]).unwrap().to_ndarray::<f32>().unwrap();
    assert_eq!(r[[5, 3]], 23.);
    let n = a.narrow(2, 1, 2).unwrap().to_ndarray::<f32>().unwrap();
    assert_eq!(n.shape(), &[2, 3, 2]);
    assert_eq!(n[[1, 2, 1]], 12. + 8. + 2.);
    let flat = a.reshape([24]).unwrap();
    let run = flat.elements(5, 7).unwrap().to_ndarray::<f32>().unwrap();
    assert_eq!(
        run.into_raw_vec_and_offset().0,
        (5..12).map(|x| x as f32).collect::<Vec<_>>()
    );
    assert_eq!(flat.elements(24, 0).unwrap().shape().dims(), &[0]);
    let e = a.elements(0, 1).unwrap_err().to_string();
    assert!(
        e.contains("elements views a 1-d tensor, not [2, 3, 4]"),
        "{e}"
    );
    let e = flat.elements(20, 5).unwrap_err().to_string();
    assert!(
        e.contains("range 20..20+5 out of bounds for dim 0 of size 24"),
        "{e}"
    );
    let c = Tensor::concat(&[&a, &a], 1).unwrap();
    assert_eq!(c.shape().dims(), &[2, 6, 4]);
    let tr = a.transpose(0, -1).unwrap();
    assert_eq!(tr.shape().dims(), &[4, 3, 2]);
}

#[test]
fn nn_ops_and_backward() {
    let w = t((0..12).map(|x| x as f32).collect(), &[4, 3]);
    let ids = Tensor::from_vec(vec![3i64, 0, 3], [3]).unwrap();
    let e = Tensor::embedding(&ids, &w)
        .unwrap()
        .to_ndarray::<f32>()
        .unwrap();
    close(
        &e,
        &array![[9., 10., 11.], [0., 1., 2.], [9., 10., 11.]].into_dyn(),
    );
    let dy = Tensor::ones([3, 3], DType::F32);
    let dw = Tensor::embedding_backward(&ids, &dy, 4)
        .unwrap()
        .to_ndarray::<f32>()
        .unwrap();
    close(
        &dw,
        &array![[1., 1., 1.], [0., 0., 0.], [0., 0., 0.], [2., 2., 2.]].into_dyn(),
    );
    let bad = Tensor::from_vec(vec![4i64], [1]).unwrap();
    assert!(Tensor::embedding(&bad, &w).is_err());

    let x = Tensor::randn([5, 8], 9, DType::F32);
    let g = Tensor::ones([8], DType::F32);
    let b = Tensor::zeros([8], DType::F32);
    let y = x
        .layer_norm(&g, &b, 1e-5)
        .unwrap()
        .to_ndarray::<f32>()
        .unwrap();
    for row in y.outer_iter() {
        let m: f32 = row.sum() / 8.0;
        let v: f32 = row.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / 8.0;
        assert!(m.abs() < 1e-5 && (v - 1.0).abs() < 1e-3);
    }
    // Layer norm backward against finite differences of sum(y * r).
    let r = Tensor::randn([5, 8], 10, DType::F32)
        .cast(DType::F64)
        .unwrap();
    let x64 = x.cast(DType::F64).unwrap();
    let g64 = Tensor::randn([8], 11, DType::F64);
    let b64 = Tensor::zeros([8], DType::F64);
    let dx = Tensor::layer_norm_backward(&x64, &g64, &r, 1e-5)
        .unwrap()
        .to_ndarray::<f64>()
        .unwrap();
    let f = |xv: &ArrayD<f64>| -> f64 {
        let xt = Tensor::from_array(xv.clone());
        let y = xt.layer_norm(&g64, &b64, 1e-5).unwrap();
        y.mul(&r)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_ndarray::<f64>()
            .unwrap()
            .sum()
    };
    let xv = x64.to_ndarray::<f64>().unwrap();
    for idx in [[0usize, 0usize], [3, 5], [4, 7]] {
        let mut xp = xv.clone();
        xp[IxDyn(&idx)] += 1e-6;
        let mut xm = xv.clone();
        xm[IxDyn(&idx)] -= 1e-6;
        let num = (f(&xp) - f(&xm)) / 2e-6;
        assert!(
            (num - dx[IxDyn(&idx)]).abs() < 1e-5,
            "{num} vs {}",
            dx[IxDyn(&idx)]
        );
    }

    let logits = t(vec![1., 2., 3., 1., 1., 1.], &[2, 3]);
    let labels = Tensor::from_vec(vec![2i64, 0], [2]).unwrap();
    let l = logits
        .cross_entropy(&labels)
        .unwrap()
        .to_ndarray::<f32>()
        .unwrap();
    let lse = (1f32.exp() + 2f32.exp() + 3f32.exp()).ln();
    assert!((l[[0]] - (lse - 3.)).abs() < 1e-5);
    assert!((l[[1]] - 3f32.ln()).abs() < 1e-5);
    let dl = Tensor::cross_entropy_backward(&logits, &labels, &Tensor::ones([2], DType::F32))
        .unwrap()
        .to_ndarray::<f32>()
        .unwrap();
    assert!((dl.index_axis(ndarray::Axis(0), 1).sum()).abs() < 1e-6);
    assert!((dl[[1, 0]] - (1. / 3. - 1.)).abs() < 1e-6);

    // Unary backward against finite differences.
    let xs = Tensor::from_vec(vec![-1.3f64, -0.2, 0.4, 2.0], [4]).unwrap();
    for u in [
        UnaryOp::Gelu,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Exp,
        UnaryOp::Square,
    ] {
        // The backward reads what the forward saves: y for exp, tanh and sigmoid, else x.
        let saved = if u.saves_output() {
            xs.unary(u).unwrap()
        } else {
            xs.clone()
        };
        let d = Tensor::ones([4], DType::F64)
            .unary_backward(u, &saved)
            .unwrap()
            .to_ndarray::<f64>()
            .unwrap();
        let xv = xs.to_ndarray::<f64>().unwrap();
        for i in 0..4 {
            let fp = Tensor::from_vec(vec![xv[[i]] + 1e-6], [1])
                .unwrap()
                .unary(u)
                .unwrap()
                .to_vec::<f64>()
                .unwrap()[0];
            let fm = Tensor::from_vec(vec![xv[[i]] - 1e-6], [1])
                .unwrap()
                .unary(u)
                .unwrap()
                .to_vec::<f64>()
                .unwrap()[0];
            assert!(
                ((fp - fm) / 2e-6 - d[[i]]).abs() < 1e-5,
                "{u:?} at {}",
                xv[[i]]
            );
        }
    }
    // Softmax backward: rows of dx sum to zero.
    let y = x.softmax(1).unwrap();
    let dx = Tensor::softmax_backward(&y, &Tensor::randn([5, 8], 12, DType::F32), 1).unwrap();
    for row in dx.to_ndarray::<f32>().unwrap().outer_iter() {
        assert!(row.sum().abs() < 1e-5);
    }
}

#[test]
fn typed_errors_local() {
    let a = Tensor::zeros([2, 3], DType::F32);
    let b = Tensor::zeros([4, 3], DType::F32);
    let e = a.add(&b).unwrap_err().to_string();
    assert!(
        e.contains("add") && e.contains("[2, 3]") && e.contains("[4, 3]"),
        "{e}"
    );
    let c = Tensor::zeros([2, 3], DType::F64);
    let e = a.add(&c).unwrap_err().to_string();
    assert!(
        e.contains("dtype") && e.contains("f32") && e.contains("f64"),
        "{e}"
    );
    assert!(a.matmul(&a).is_err());
    assert!(a.sum(&[2], false).is_err());
}
