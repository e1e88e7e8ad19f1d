"""Models for the training and inference benchmarks, built in-process (torchvision or transformers when
installed, built-in otherwise), with synthetic batches made on the device: nothing is downloaded."""
import dataclasses
import math


class BenchError(Exception):
    """Bad input to a benchmark: the command line prints its message as one line and exits non-zero."""


@dataclasses.dataclass
class Workload:
    name: str
    model: object  # torch.nn.Module
    source: str  # where the architecture came from
    kind: str  # "image" (NCHW float, class labels) or "text" (token ids, next-token labels)
    shape: tuple  # one sample's input shape
    classes: int
    default_batch: int

    def batch(self, size, device, generator=None):
        """A synthetic (inputs, targets) batch on the device."""
        import torch

        if self.kind == "image":
            x = torch.randn((size, *self.shape), device=device, generator=generator)
            return x, torch.randint(0, self.classes, (size,), device=device, generator=generator)
        tokens = torch.randint(0, self.classes, (size, self.shape[0] + 1), device=device, generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    def loss(self, inputs, targets):
        import torch.nn.functional as F

        out = self.model(inputs)
        out = getattr(out, "logits", out)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]).float(), targets.reshape(-1))

    @property
    def parameters(self):
        return sum(p.numel() for p in self.model.parameters())


def _tiny_cnn(torch, classes):
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes))


def _gpt(torch, vocab, context, layers, width, heads):
    """A GPT-2-shaped decoder (pre-norm blocks, causal attention through scaled_dot_product_attention)."""
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"), nn.Linear(4 * width, width))

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, c // heads).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)
            self.head.weight = self.tokens.weight  # tied, as GPT-2's

        def forward(self, ids):
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            return self.head(self.ln(self.blocks(x)))

    return GPT()


def _torchvision(name):
    try:
        import torchvision
    except ImportError:
        raise BenchError(f"--model {name} needs torchvision, which is not installed here "
                         f"(pip install torchvision; tiny-cnn is built in)") from None
    return getattr(torchvision.models, name)(weights=None), f"torchvision {torchvision.__version__}"


def _gpt2_medium(torch):
    try:
        import transformers
    except ImportError:
        return _gpt(torch, 50257, 1024, 24, 1024, 16), "built-in GPT-2 Medium (transformers not installed)"
    config = transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16, n_positions=1024)
    return transformers.GPT2LMHeadModel(config), f"transformers {transformers.__version__} GPT2Config"


# name -> (builder(torch) -> (model, source), kind, sample shape, classes, the seeds' batch size)
MODELS = {
    "resnet50": (lambda torch: _torchvision("resnet50"), "image", (3, 224, 224), 1000, 256),
    "resnet18": (lambda torch: _torchvision("resnet18"), "image", (3, 224, 224), 1000, 1),
    "vit_b_16": (lambda torch: _torchvision("vit_b_16"), "image", (3, 224, 224), 1000, 128),
    "gpt2-medium": (_gpt2_medium, "text", (1024,), 50257, 16),
    # GPT-2 small (12 layers, 768 wide, 12 heads, ~124 M parameters), built in: bench distributed's model
    "gpt2-small": (lambda torch: (_gpt(torch, 50257, 1024, 12, 768, 12), "built-in GPT-2 small"), "text", (1024,),
                   50257, 8),
    "tiny-cnn": (lambda torch: (_tiny_cnn(torch, 10), "built-in"), "image", (3, 32, 32), 10, 32),
    "tiny-gpt": (lambda torch: (_gpt(torch, 512, 64, 2, 64, 4), "built-in"), "text", (64,), 512, 8),
}


def build(name, device, seed=0) -> Workload:
    import torch

    if name not in MODELS:
        raise BenchError(f"--model: unknown model {name!r} (choose from {', '.join(MODELS)})")
    builder, kind, shape, classes, default_batch = MODELS[name]
    torch.manual_seed(seed)
    model, source = builder(torch)
    return Workload(name, model.to(device), source, kind, shape, classes, default_batch)


def gpu_capability(device):
    import torch

    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def check_precision(precision, device):
    """BenchError for a precision this device cannot run (tf32/bf16 need Ampere, fp16 and tf32 a GPU)."""
    if precision not in PRECISIONS:
        raise BenchError(f"--precision: unknown precision {precision!r} (choose from {', '.join(PRECISIONS)})")
    cap = gpu_capability(device)
    if cap is None and precision in ("fp16", "tf32"):
        raise BenchError(f"--precision {precision}: needs a GPU (on the CPU: fp32 or bf16)")
    if cap is not None and cap < (8, 0) and precision in ("tf32", "bf16"):
        raise BenchError(f"--precision {precision}: needs an Ampere or newer GPU; this one is sm_{cap[0]}{cap[1]}")


PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


def default_precisions(device):
    cap = gpu_capability(device)
    if cap is None:
        return ["fp32", "bf16"]
    return list(PRECISIONS) if cap >= (8, 0) else ["fp32", "fp16"]


def parse_list(text, what):
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise BenchError(f"--{what}: expected a comma-separated list, got {text!r}")
    return items


def parse_batch_sizes(text):
    """'auto' or a list of positive ints."""
    items = parse_list(text, "batch-size")
    if items == ["auto"]:
        return "auto"
    sizes = []
    for t in items:
        if not t.isdigit() or int(t) < 1:
            raise BenchError(f"--batch-size: expected 'auto' or positive integers, got {t!r} in {text!r}")
        sizes.append(int(t))
    return sizes


def percentile(sorted_values, q):
    """The q-th percentile (0..100) of sorted values, linear between neighbours."""
    i = (len(sorted_values) - 1) * q / 100
    lo, hi = math.floor(i), math.ceil(i)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (i - lo)
