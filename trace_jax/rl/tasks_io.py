"""Between tasks (text) and the rollout engine and trainer (tokens).

``TaskIO`` turns problems into prompt tokens, runs single-turn generation or multi-turn episodes
(the policy's turns are decoded by the engine, the environment's observations appended as
tokens the policy did not generate), scores completions, and lays out demonstrations for the
supervised warm start.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from trace_jax.config import ConfigError
from trace_jax.model.sharding import batch_part, place_rows, process_rows, processes_max
from trace_jax.rl.timing import PhaseTimer
from trace_jax.rollout import RolloutEngine, RolloutState
from trace_jax.tasks import TOKENIZER, Problem, demonstration_tokens, make_task
from trace_jax.tasks.tokenizer import Tokenizer

_PROBE = 64  # problems per split whose sizes bound the sequence length


class TaskIO:
    """Args:
    name: a registered task name.
    args: the task's knobs.
    tokenizer: renders prompts, policy turns and observations as ids, and decodes completions
      (default: the byte tokenizer of the built-in presets; a Hugging Face checkpoint's own from
      ``trace_jax.tasks.hf_tokenizer.load_hf_tokenizer``).
    """

    def __init__(self, name: str, args: dict, tokenizer: Tokenizer = TOKENIZER):
        try:
            self.task = make_task(name, **args)
        except ConfigError as e:
            message = str(e)
            raise ConfigError(
                message if message.startswith("task.") else f"task.args.{message}"
            ) from None
        self.tok = tokenizer
        self.vocab_size = self.tok.vocab_size
        self.pad_id = self.tok.pad_id
        self.multi_turn = bool(self.task.multi_turn)
        self.stop_tokens = self.tok.stop_ids(self.multi_turn)

    # ------------------------------------------------------------------ problems and sizes

    def problem(self, split: str, index: int) -> Problem:
        """Problem ``index`` of ``split`` (cycling through a finite split)."""
        return self.task.problem(split, index % self.task.num_problems(split))

    def max_len(self, max_new_tokens: int, max_turns: int) -> int:
        """Slots per sequence: the longest probed prompt and demonstration, plus the turns'
        budgets (and, multi-turn, the longest observation per turn)."""
        probes = [self.problem(s, i) for s in ("train", "eval") for i in range(_PROBE)]
        prompt = max(len(self.tok.prompt_ids(p.prompt)) for p in probes)
        demo = max(len(demonstration_tokens(self.task, p, self.tok)[0]) for p in probes)
        if not self.multi_turn:
            return max(prompt + max_new_tokens, demo)
        obs = max(
            len(self.tok.observation_ids(t.text))
            for p in probes
            for t in self.task.demonstration_turns(p)
            if t.role == "env"
        )
        return max(prompt + max_turns * (max_new_tokens + obs), demo)

    # ------------------------------------------------------------------ rollouts

    def _prompts(self, problems: list[Problem]) -> tuple[np.ndarray, np.ndarray]:
        ids = [self.tok.prompt_ids(p.prompt) for p in problems]
        width = max(len(i) for i in ids)
        tokens = np.full((len(ids), width), self.pad_id, np.int32)
        valid = np.zeros((len(ids), width), bool)
        for b, row in enumerate(ids):
            tokens[b, : len(row)] = row
            valid[b, : len(row)] = True
        return tokens, valid

    def completions(self, state: RolloutState, starts, ends) -> list[str]:
        """The text the policy generated in slots [starts[b], ends[b]) of each of this process's
        sequences b (stop tokens and any non-text ids dropped). The tokens come to the host once
        for the batch, not a device slice per row (BENCHMARKS.md, "The RL loop at `medium`,
        phase by phase")."""
        tokens, generated = process_rows(state.tokens), process_rows(state.generated)
        return [
            self.tok.decode(tokens[b, s:e][generated[b, s:e]], errors="replace")
            for b, (s, e) in enumerate(zip(starts, ends, strict=True))
        ]

    def rollout(
        self,
        engine: RolloutEngine,
        problems: list[Problem],
        key: jax.Array,
        max_turns: int,
        times: dict[str, float] | None = None,
    ) -> tuple[RolloutState, np.ndarray]:
        """Generate one sequence per problem. Returns the final state and rewards [b] float32.

        In a multi-process job ``problems`` and the rewards are this process's rows of the
        batch (``sharding.batch_part``) and the state the whole batch, every process's rows.

        ``times``, if given, receives the seconds of each part: ``rollout/prefill_s`` (prompts
        and observations appended), ``rollout/decode_s`` (the engine's decode loops) and
        ``rollout/env_s`` (the host-side reward and environment steps).
        """
        clock = PhaseTimer(times)
        tokens, valid = self._prompts(problems)
        if tokens.shape[1] >= engine.cfg.max_len:
            raise ConfigError(
                f"max_new_tokens: a prompt of {tokens.shape[1]} tokens leaves no room in "
                f"max_len={engine.cfg.max_len}"
            )
        batch = len(problems) * batch_part()[1]  # every process's rows
        state = clock("rollout/prefill_s", engine.append, engine.start(batch), tokens, valid)
        starts = process_rows(state.lengths)
        if not self.multi_turn:
            state = clock("rollout/decode_s", engine.decode, state, key)
            with clock.part("rollout/env_s"):
                texts = self.completions(state, starts, process_rows(state.lengths))
                rewards = [self.task.reward(p, t) for p, t in zip(problems, texts, strict=True)]
            return state, np.asarray(rewards, np.float32)
        return self._episodes(engine, problems, state, key, max_turns, clock)

    def _episodes(self, engine, problems, state, key, max_turns, clock):
        b_size = len(problems)
        envs = [self.task.env(p) for p in problems]
        for env, p in zip(envs, problems, strict=True):
            env.reset(p)
        finished = np.zeros(b_size, bool)
        rewards = np.zeros(b_size, np.float32)
        for turn in range(max_turns):
            before = process_rows(state.lengths)
            state = clock(
                "rollout/decode_s",
                engine.decode,
                dataclasses.replace(state, done=place_rows(finished)),
                jax.random.fold_in(key, turn),
            )
            with clock.part("rollout/env_s"):
                after = process_rows(state.lengths)
                observations = self._env_step(envs, state, before, after, finished, rewards)
            # every process's episodes ended (processes append and decode together)
            if turn == max_turns - 1 or not processes_max(int(not finished.all())):
                break
            width = max(1, max(len(o) for o in observations))
            obs_tokens = np.full((b_size, width), self.pad_id, np.int32)
            obs_valid = np.zeros((b_size, width), bool)
            for b, ids in enumerate(observations):
                obs_tokens[b, : len(ids)] = ids
                obs_valid[b, : len(ids)] = True
            state = clock("rollout/prefill_s", engine.append, state, obs_tokens, obs_valid)
        return state, rewards

    def _env_step(self, envs, state, before, after, finished, rewards) -> list[list[int]]:
        """Each unfinished episode's environment takes the turn the policy just generated
        (slots ``before``..``after``); returns the observation tokens to append (none for an
        episode that ended: ``finished`` and ``rewards`` are updated in place)."""
        max_len = state.tokens.shape[1]
        texts = self.completions(state, before, after)
        observations = []
        for b, env in enumerate(envs):
            if finished[b]:
                observations.append([])
                continue
            obs, done, reward = env.step(texts[b])
            ids = self.tok.observation_ids(obs)
            if done or after[b] + len(ids) >= max_len:  # no room for another turn: ends
                finished[b] = True
                rewards[b] = reward if done else 0.0
                ids = []
            observations.append(ids)
        return observations

    # ------------------------------------------------------------------ warm start

    def demonstrations(
        self, problems: list[Problem], max_len: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Demonstration episodes as host arrays (tokens [B, max_len] int32, loss mask
        [B, max_len] bool)."""
        tokens = np.full((len(problems), max_len), self.pad_id, np.int32)
        mask = np.zeros((len(problems), max_len), bool)
        for b, p in enumerate(problems):
            ids, m = demonstration_tokens(self.task, p, self.tok)
            if len(ids) > max_len:
                raise ConfigError(
                    f"max_new_tokens: the demonstration of {p.id} has {len(ids)} tokens, more "
                    f"than max_len={max_len}"
                )
            tokens[b, : len(ids)] = ids
            mask[b, : len(ids)] = m
        return tokens, mask
