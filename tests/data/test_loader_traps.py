"""hotloop.DataLoader's errors say what the user did, not what hotloop's machinery did: ragged batches and spawn without a __main__ guard."""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.utils.data import Dataset
from torch.utils.data import DataLoader as TorchDataLoader

import hotloop

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Ragged(Dataset):
    """Samples of one shape up to `first_ragged`, then each of its own: the first batches fit the ring."""

    def __init__(self, first_ragged):
        self.first_ragged = first_ragged

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.zeros(3, 8 + max(0, i - self.first_ragged + 1), 8), i


@pytest.mark.parametrize("first_ragged", [0, 8], ids=["first-batch", "after-the-ring"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_ragged_batch_raises_torch_error_alone(num_workers, first_ragged):
    """Once, the worker's traceback led with hotloop's internal FastPathDeclined ("During handling of
    the above exception, another exception occurred")."""
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size") as torch_error:
        list(TorchDataLoader(Ragged(first_ragged), batch_size=4, num_workers=num_workers))
    with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size") as ours:
        list(hotloop.DataLoader(Ragged(first_ragged), batch_size=4, num_workers=num_workers))
    message = str(ours.value)
    assert "FastPathDeclined" not in message and "During handling" not in message, message
    assert ours.value.__context__ is None or "FastPathDeclined" not in repr(ours.value.__context__)
    assert type(ours.value) is type(torch_error.value)


def test_spawn_without_main_guard_names_the_guard(tmp_path):
    """A script that iterates a spawn loader at its top level: each worker imports it again and dies
    starting workers of its own. Once, the workers were restarted and the dataset blamed."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import hotloop

        class Numbers(torch.utils.data.Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                return torch.tensor([i])

        print(len(list(hotloop.DataLoader(Numbers(), batch_size=2, num_workers=2,
                                          multiprocessing_context="spawn"))))
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: DataLoader worker"), run.stderr[-3000:]
    assert "before it started running (multiprocessing_context='spawn'" in last
    assert 'put that code under `if __name__ == "__main__":`' in last
    assert "kills its worker" not in last and "were restarted" not in last


def test_spawn_with_main_guard_still_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        import hotloop

        class Numbers(torch.utils.data.Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                return torch.tensor([i])

        if __name__ == "__main__":
            print(torch.cat(list(hotloop.DataLoader(Numbers(), batch_size=2, num_workers=2,
                                                    multiprocessing_context="spawn"))).flatten().tolist())
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str(list(range(8)))
