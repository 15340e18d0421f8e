"""The run's own curves: which points each metric's line has."""

import subprocess

from trace_jax.rl import runlog

RECORDS = [
    {"step": 0, "sft/loss": 2.0},
    {"step": 1, "reward": 0.1, "eval/reward_start": 0.25},  # the evaluation before RL
    {"step": 2, "reward": 0.2},
    {"step": 3, "reward": 0.3, "eval/reward": 0.5},
]


def test_the_eval_curve_starts_with_the_evaluation_before_rl():
    assert runlog.curve_points(RECORDS, "eval/reward") == [(1, 0.25), (3, 0.5)]
    assert runlog.curve_points(RECORDS, "reward") == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert runlog.curve_points(RECORDS, "sft/loss") == [(0, 2.0)]


def _git(repo, *args):
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t"}
    env |= {"GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo)}
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_checkout_with_a_stale_head_is_named_by_the_commit_of_its_files(tmp_path, monkeypatch):
    """A GPU machine's copy of the working tree can carry an older ``.git``: its HEAD and
    ``dirty`` then say nothing of what ran; the files' tree names the commit they are."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("runs/\n")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "A")
    old = _git(repo, "rev-parse", "HEAD")
    (repo / "a.py").write_text("x = 2\n")
    _git(repo, "commit", "-qam", "B")
    new, new_tree = _git(repo, "rev-parse", "HEAD"), _git(repo, "rev-parse", "HEAD^{tree}")
    _git(repo, "branch", "b")  # the repository that reads the record holds B
    _git(repo, "reset", "-q", "--soft", old)  # HEAD back at A, B's files on disk
    (repo / "runs").mkdir()
    (repo / "runs" / "out.txt").write_text("ignored\n")
    monkeypatch.setattr(runlog, "_ROOT", repo)
    runlog._commits_by_tree.cache_clear()
    objects = sorted(p.name for p in (repo / ".git" / "objects").rglob("*"))
    monkeypatch.setenv("XLA_FLAGS", " --xla_backend_optimization_level=0 ")
    origin = runlog.provenance()
    assert origin["commit"] == old and origin["dirty"] and origin["tree"] == new_tree
    # what changes a run's roundings besides its code: XLA's flags, the host's CPU
    assert origin["xla_flags"] == "--xla_backend_optimization_level=0"
    assert origin["host"] == runlog.host_cpu() != ""
    assert sorted(p.name for p in (repo / ".git" / "objects").rglob("*")) == objects  # unwritten
    assert runlog.code_label(origin) == new[:7]
    # files that are no commit's: the recorded HEAD, marked
    (repo / "b.py").write_text("y = 3\n")  # untracked files travel with a copy, and count
    origin = runlog.provenance()
    assert origin["tree"] != new_tree and runlog.code_label(origin) == f"{old[:7]} +dirty"
    assert runlog.code_label({}) == "unknown"
    runlog._commits_by_tree.cache_clear()


def test_the_code_a_run_executes_is_named_apart_from_the_commit(tmp_path, monkeypatch):
    """Commits that change documents alone ran the same code (``run_code`` equal); one that
    changes the package, the configs or the entry point did not; a tree this repository does
    not hold is unknown (None)."""
    repo = tmp_path / "repo"
    for path, text in {
        "trace_jax/a.py": "x = 1\n",
        "configs/c.yaml": "lr: 1\n",
        "experiments/runner.py": "run = 1\n",
        "experiments/report.py": "table = 1\n",
        "README.md": "one\n",
    }.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    _git(repo, "init", "-q")
    trees = []

    def commit(path, text):
        if path:
            (repo / path).write_text(text)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", path or "first")
        trees.append(_git(repo, "rev-parse", "HEAD^{tree}"))

    commit(None, None)
    commit("README.md", "two\n")  # documents and reports: the same code ran
    commit("experiments/report.py", "table = 2\n")
    commit("trace_jax/a.py", "x = 2\n")  # the package, a config, the entry point: not
    commit("configs/c.yaml", "lr: 2\n")
    commit("experiments/runner.py", "run = 2\n")
    monkeypatch.setattr(runlog, "_ROOT", repo)
    runlog.run_code.cache_clear()
    ids = [runlog.run_code(t) for t in trees]
    assert ids[0] == ids[1] == ids[2] and len(set(ids[2:])) == 4, ids
    assert runlog.run_code("0" * 40) is None and runlog.run_code(None) is None
    runlog.run_code.cache_clear()


def test_the_phase_means_leave_out_the_steps_that_compiled():
    # RL steps: the first (compiles), a steady one, one that met a new program (e.g. a new
    # trainer width under trim_padding), a steady one
    records = [
        {"step": 0, "reward": 0.0, "step_s": 30.0, "rollout/decode_s": 9.0, "compile_s": 29.0},
        {"step": 1, "reward": 0.0, "step_s": 1.0, "rollout/decode_s": 0.25, "compile_s": 0.0},
        {"step": 2, "reward": 0.0, "step_s": 12.0, "rollout/decode_s": 0.25, "compile_s": 11.0},
        {"step": 3, "reward": 0.0, "step_s": 2.0, "rollout/decode_s": 0.75, "compile_s": 0.0},
    ]
    summary = runlog.summarize(records)
    assert summary["time/step_s"] == 1.5 and summary["time/rollout/decode_s"] == 0.5
    assert summary["timed_steps"] == 2 and "time/compile_s" not in summary  # no phase
    rows = {key: label for key, label, _ in runlog.summary_rows(summary)}
    assert (
        rows["time/step_s"]
        == "step_s: mean seconds a step over the 2 RL steps that compiled nothing"
    )
    # every step after the first compiled: their means, not none
    every = [{**r, "compile_s": 1.0} for r in records]
    assert runlog.summarize(every)["time/step_s"] == 5.0
    # records from before the key: the steps after the first
    old = [{k: v for k, v in r.items() if k != "compile_s"} for r in records]
    assert runlog.summarize(old)["time/step_s"] == 5.0


def test_compile_seconds_count_a_new_program_and_not_a_cached_one():
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)
    x = jnp.ones(7)
    y = x + 1.0  # (an eager op is a program too: made before the count starts)
    runlog.compile_seconds()
    f(x).block_until_ready()
    assert runlog.compile_seconds() > 0
    f(y).block_until_ready()  # the same program
    assert runlog.compile_seconds() == 0.0
