"""The RL loop across processes: a part of a batch samples what the whole batch would (per-row
keys), and two local CPU processes run the loop with the weights split over them to the metrics
of one process with the same mesh; before its run, the one process checks that the sharded
forward, RL step and rollout on a (data, fsdp, expert) mesh equal one device's, and the two join
through the entry point and reduce a global batch (``sharded_step_check.py``)."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import portpicker
import pytest
from cpu_jobs import ROOT, cpu_env
from flax import nnx

from trace_jax.model import ModelConfig, QuantPolicy, Transformer
from trace_jax.rollout import RolloutConfig, RolloutEngine


def test_a_row_samples_the_same_tokens_in_any_part_of_its_batch():
    # the shapes of test_trainer.py's BF16 rollouts (8 rows): the whole batch's programs are
    # shared through the persistent compilation cache; its halves compile once
    model = Transformer(ModelConfig.preset("tiny").replace(num_layers=1), nnx.Rngs(0))
    engine = RolloutEngine(model, QuantPolicy.bf16(), RolloutConfig(max_len=12, max_new_tokens=6))
    prompts = [[1, 2, 3]] * 8  # one prompt: the rows differ by their keys alone
    key = jax.random.key(3)
    whole = engine.generate(prompts, key)
    tokens = np.asarray(whole.tokens)
    assert len({tuple(t) for t in tokens}) == 8, tokens  # each row has its own key
    # e.g. process 1's half of the batch; any rows in any order (one shape: one compiled set)
    for part in ([0, 1, 2, 3], [4, 5, 6, 7], [7, 0, 5, 2]):
        got = engine.generate([prompts[i] for i in part], key, row_ids=np.asarray(part))
        np.testing.assert_array_equal(np.asarray(got.tokens), tokens[part])
        # float32 rounding: XLA:CPU picks its matmul kernels by shape, and the batch is a dim
        want = np.asarray(whole.logprobs)[part]
        np.testing.assert_allclose(np.asarray(got.logprobs), want, rtol=4e-7, atol=0)


# A run that learns within its warm start (the 25 additions of 0-4, a half reward for a wrong
# but well-formed answer), so that rewards, advantages and the RL loss are not all zero; FP4
# rollout with TRACE guidance (spilled through tensorstore), code metrics on every row; every
# parameter split in halves over the two devices (FSDP), across processes over the processes.
CONFIG = """
experiment: fp4_trace
task: {name: reasoning, args: {num_operands: 2, max_value: 4, ops: ["+"], format_reward: 0.5}}
model: tiny
model_overrides: {num_layers: 1}
steps: 2
prompts_per_step: 2
group_size: 2
max_new_tokens: 12
warm_start: {steps: 16, batch: 4, lr: 0.01}
eval_every: 1
eval_problems: 4
eval_split: train
checkpoint_every: 100  # the final checkpoint only (8 saves more cost ~3 s of orbax a process)
guidance_host_bytes: 0
mesh_fsdp: 2
tensorboard: false
plot: false
"""


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_processes_keep_the_weights_split_and_run_the_loop_of_one_with_the_same_mesh(tmp_path):
    """``sharded_step_check.py``: in one process of 8 devices, its sharded forward, step and
    rollout checks, then the run of ``CONFIG`` on 2 of the devices; in a job of 2 processes of
    one device each, the global batch and the refusals, then the run of ``CONFIG``: the weights
    of trainer and engines split in halves (across processes: none whole on one), and process 0
    of the job writes the one process's metrics. The three processes run at once."""
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG)
    script = [sys.executable, str(Path(__file__).with_name("sharded_step_check.py"))]
    job = {"JAX_COORDINATOR_ADDRESS": f"localhost:{portpicker.pick_unused_port()}"}
    runs = [([*script, "one", str(config), str(tmp_path / "one")], cpu_env(devices=8))]
    runs += [
        (
            [*script, "job", str(config), str(tmp_path / "two")],
            cpu_env(**job, JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=i),
        )
        for i in "01"
    ]
    out = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    procs = [subprocess.Popen(cmd, env=env, **out) for cmd, env in runs]
    try:  # a process that fails leaves the other of its job waiting: the timeout ends it
        outs = [p.communicate(timeout=900)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    assert "sharded forward OK" in outs[0] and "sharded RL step OK" in outs[0]
    assert all("sharded RL loop OK" in out for out in outs)
    want = float(sum(range(24)))  # the global [8, 3] batch is 0..23
    for index, out in enumerate(outs[1:]):
        assert f"process {index} of 2: sum {want}" in out, out[-3000:]
        assert "refused: prompts_per_step: 3 does not split over the job's 2" in out
        assert "refused: mesh_data x mesh_fsdp x mesh_expert: 1 x 1 x 1" in out
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in two] == list(range(18))  # process 0's records alone
    assert (tmp_path / "two" / "checkpoints" / "17").is_dir()
    assert one[15]["sft/loss"] < one[0]["sft/loss"] / 4  # the warm start learns
    rl = one[16:]
    assert {r["reward"] for r in rl} - {0.0} and {r["train/loss"] for r in rl} - {0.0}
    assert all(r["mismatch/logp_abs"] < 0.05 for r in rl)
    for a, b in zip(one, two, strict=True):
        assert sorted(a) == sorted(b)
        for key, want in a.items():
            if not key.endswith(("_s", "_ms")):  # all but wall clock: the same programs
                np.testing.assert_equal(b[key], want, err_msg=f"step {a['step']}: {key}")
