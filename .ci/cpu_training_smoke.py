"""Three CPU training steps with every hotloop piece (DataLoader with workers, GradScaler("cpu"), the fused
AdamW's C step, @memory_monitor) against the same steps with torch's pieces from the same seed: .ci/release-check
runs it in a fresh venv where hotloop came from its wheel. Exits non-zero where the two disagree."""
import os
import sys

import torch

import hotloop

STEPS = 3


class Images(torch.utils.data.Dataset):
    """uint8 HWC images and labels, drawn afresh each run from the seed in argv."""

    def __init__(self, seed):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (STEPS * 16, 8, 8, 3), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, 10, (STEPS * 16,), generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def train(seed, pieces):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 3, 10))
    order = torch.Generator().manual_seed(seed + 1)
    if pieces == "hotloop":
        loader = hotloop.DataLoader(Images(seed), batch_size=16, shuffle=True, num_workers=2, generator=order)
        scaler = hotloop.GradScaler("cpu")
        optimizer = hotloop.optim.AdamW(model.parameters(), lr=1e-2)
    else:
        loader = torch.utils.data.DataLoader(Images(seed), batch_size=16, shuffle=True, num_workers=2, generator=order)
        scaler = torch.amp.GradScaler("cpu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for images, labels in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images.float() / 255), labels)
        scaler.scale(loss).backward()
        if pieces == "hotloop":
            scaler.clip_grad_norm_(optimizer, max_norm=1.0)  # one C pass: inf/NaN check, norm, clip factor
        else:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def main():
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    theirs = train(seed, "torch")
    ours = hotloop.memory_monitor(train)(seed, "hotloop")  # the host report goes to stderr
    assert len(ours[0]) == STEPS, ours[0]
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(theirs[0]), rtol=1e-5, atol=1e-6)
    for a, b in zip(ours[1], theirs[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    print(f"{STEPS} steps, losses {', '.join(f'{x:.4f}' for x in ours[0])}, as torch's; hotloop {hotloop.__version__} "
          f"from {os.path.dirname(hotloop.__file__)}", flush=True)


if __name__ == "__main__":
    main()
