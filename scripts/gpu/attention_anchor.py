"""torch SDPA on the cuDNN backend beside OxiFlow's fused attention (gpu_kernels_check): same
shape (B 16, H 12, T 1024, D 64, causal, bf16), Q, K, V as three [B, T, H, D] tensors read as
[B, H, T, D] views (the layout the check times), forward and forward+backward TFLOP/s (CUDA events, warm-up, median; fwd+bwd
counted as 3.5x the forward's 4 B H T^2 D / 2), and the error against a float64 reference.
Prints rows in gpu_kernels_check's table format."""
import argparse
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def median_ms(fn, reps):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args()
    B, H, T, D = 16, 12, 1024, 64
    dev = "cuda"
    torch.manual_seed(0)
    sets = []

    def draw():
        return ((torch.rand(B, T, H, D, device=dev) * 0.9 + 0.1) * torch.where(torch.rand(B, T, H, D, device=dev) < 0.5, -1.0, 1.0)).to(torch.bfloat16)

    for _ in range(2):
        qkv = [draw().requires_grad_(True) for _ in range(3)]  # Q, K, V, each [B, T, H, D]
        sets.append((qkv, draw()))

    def views(qkv):
        return [x.transpose(1, 2) for x in qkv]

    label = f"B{B} H{H} T{T} D{D} causal"
    fwd_flops = 4 * B * H * T * T * D / 2
    rows = []
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        qkv, do = sets[0]
        q, k, v = views(qkv)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.transpose(1, 2).backward(do)
        g = torch.stack([x.grad for x in qkv])
        for x in qkv:
            x.grad = None
        # float64 reference (materialised, autograd).
        q64 = [x.detach().double().requires_grad_(True) for x in qkv]
        qq, kk, vv = views(q64)
        s = (qq @ kk.transpose(-1, -2)) / D ** 0.5
        mask = torch.ones(T, T, device=dev, dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
        o64 = torch.softmax(s, -1) @ vv
        o64.transpose(1, 2).backward(do.double())
        rows.append(("torch sdpa cudnn fwd O", rel(out, o64.detach())))
        rows.append(("torch sdpa cudnn bwd dQKV", rel(g, torch.stack([x.grad for x in q64]))))
        del q64, qq, kk, vv, s, o64

        def fwd(i=[0]):
            i[0] += 1
            q, k, v = views(sets[i[0] % 2][0])
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(i=[0]):
            i[0] += 1
            qkv, do = sets[i[0] % 2]
            q, k, v = views(qkv)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.transpose(1, 2).backward(do)
            for x in qkv:
                x.grad = None

        ms_f = median_ms(fwd, a.reps)
        ms_fb = median_ms(fwd_bwd, a.reps)
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    print("| check | dtype | shape | ‖out − ref‖/‖ref‖ | tol | result | note |")
    print("|---|---|---|---|---|---|---|")
    for name, e in rows:
        print(f"| {name} | bf16 | {label} | {e:.2e} | 1e-02 | {'pass' if e <= 1e-2 else 'FAIL'} | |")
    print()
    print("| timing | dtype | shape | ms | rate | ceiling |")
    print("|---|---|---|---|---|---|")
    print(f"| torch sdpa cudnn fwd | bf16 | {label} | {ms_f:.4f} | {fwd_flops / ms_f / 1e9:.1f} TFLOP/s | |")
    print(f"| torch sdpa cudnn fwd+bwd | bf16 | {label} | {ms_fb:.4f} | {3.5 * fwd_flops / ms_fb / 1e9:.1f} TFLOP/s | |")


if __name__ == "__main__":
    main()
