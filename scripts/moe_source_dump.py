import inspect, transformers
from transformers.models.mixtral import modeling_mixtral as m
from transformers.models.qwen2_moe import modeling_qwen2_moe as q
print("transformers", transformers.__version__)
for mod in (m, q):
    for name, obj in inspect.getmembers(mod, inspect.isclass):
        if obj.__module__ == mod.__name__ and any(k in name for k in ("Sparse", "Expert", "Router", "MLP", "Moe", "MoE", "Block")):
            print("=" * 20, mod.__name__, name)
            print(inspect.getsource(obj))
    print(inspect.getsource(mod.load_balancing_loss_func))
try:
    from transformers import conversion_mapping as cm
    print(inspect.getsource(cm)[:6000])
except Exception as e:
    print("no conversion_mapping", e)
