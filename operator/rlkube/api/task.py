"""spec.task: where the prompts come from (a built-in task, a dataset, reasoning-gym, an environment or your own
factory) and how completions are scored; read by the actors (rlkube.core.actor) and checked by
lifecycle/validation.py."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlkube.api.base import Model

ENTRY_POINT = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
"""`package.module:attribute`, the form of every importable plug-in (task factories, reward functions)."""

Scalar = str | int | float | bool


class DatasetSpec(Model):
    """Prompts read from a file or a `datasets` directory inside the pods (an image, a volume, or `claimName`)."""

    path: str = Field(
        ...,
        min_length=1,
        description=(
            "A JSONL or Parquet file (a glob matches several), or a directory written by `datasets`' "
            "save_to_disk, as seen inside the actor pods."
        ),
    )
    format: Literal["auto", "jsonl", "parquet", "datasets"] = Field(
        "auto",
        description="`auto`: a directory is a `datasets` directory, else the file extension decides "
        "(.jsonl/.json, .parquet).",
    )
    split: str | None = Field(
        None,
        min_length=1,
        description="Split to read: a split of a saved DatasetDict, or a `datasets` split expression for files "
        "(`train[:1000]`). Unset: `train` (a saved single Dataset has no splits).",
    )
    prompt_field: str | None = Field(
        None, min_length=1, description="Column holding the prompt text (default `prompt` unless messagesField is set)."
    )
    messages_field: str | None = Field(
        None,
        min_length=1,
        description="Column holding the prompt as chat messages ([{role, content}, ...]) instead of text; "
        "needs a tokenizer with a chat template.",
    )
    answer_field: str | None = Field(
        None,
        min_length=1,
        description="Column holding the reference answer the rewards compare with. Unset: `answer` when the "
        "dataset has that column (rows without an answer suit only rewards that need none).",
    )
    completion_field: str | None = Field(
        None,
        min_length=1,
        description="Column holding the reference completion of each prompt: with loss sft (which requires it) the "
        "actors read prompt + completion from the dataset instead of sampling, one document per row, only the "
        "completion's tokens in the loss. Refused with any other loss.",
    )
    system_prompt: str | None = Field(
        None, description="A system message put before every prompt (needs the chat template)."
    )
    shuffle: bool = Field(
        True,
        description="Draw prompts in a new random order every epoch (else in file order); actor replicas take "
        "interleaved turns, so they do not repeat each other.",
    )
    shuffle_seed: int = Field(0, ge=0, description="Seed of the shuffled orders.")
    claim_name: str | None = Field(
        None,
        min_length=1,
        description="PersistentVolumeClaim holding the dataset, mounted read-only at mountPath in the actor pods.",
    )
    mount_path: str = Field(
        "/data", pattern=r"^/", description="Where claimName is mounted; path must then lie below it."
    )

    @property
    def prompt_column(self) -> str | None:
        """The text column actually read: promptField, or `prompt` when neither field is set."""
        if self.prompt_field:
            return self.prompt_field
        return None if self.messages_field else "prompt"


class RewardSpec(Model):
    """How a completion is scored. Verifiers compare with the prompt's reference answer (answerField)."""

    type: Literal["math", "exact", "regex", "python"] = Field(
        ...,
        description="`math`: math-verify equivalence with the answer; `exact`: string equality after "
        "`normalize`; `regex`: 1 when `pattern` matches (its group `answer`, if any, must equal the answer); "
        "`python`: `function`(completion, answer, sample, **params) returns the score.",
    )
    pattern: str | None = Field(None, min_length=1, description="Regular expression of the `regex` reward.")
    function: str | None = Field(
        None, pattern=ENTRY_POINT, description="Importable `package.module:function` of the `python` reward."
    )
    params: dict[str, Scalar] = Field(
        default_factory=dict, description="Keyword arguments passed to the `python` reward function."
    )
    answer_pattern: str | None = Field(
        None,
        min_length=1,
        description="`math`/`exact`: take the answer from the completion's first match of this regular "
        "expression (its group `answer`, else group 1); no match scores 0.",
    )
    normalize: Literal["none", "strip", "whitespace"] = Field(
        "strip",
        description="`exact`/`regex` answers: `strip` trims whitespace at both ends, `whitespace` also "
        "collapses inner runs of whitespace to one space.",
    )
    ignore_case: bool = Field(False, description="`exact`/`regex`: compare and match without regard to case.")
    match: Literal["full", "prefix"] = Field(
        "full", description="`exact`: the whole completion must equal the answer, or only begin with it."
    )


class SandboxSpec(Model):
    """Limits of the subprocess sandbox that code-execution tools (the built-in `python` tool) run snippets in
    (rlkube.core.actor.sandbox): no network, none of the role's environment variables and a fresh temporary directory,
    always."""

    timeout_seconds: float = Field(5.0, gt=0, le=3600, description="Wall-clock seconds per snippet; past it the "
                                   "snippet is killed and the tool answers so (a tool timeout).")
    cpu_seconds: int = Field(5, ge=1, le=3600, description="CPU seconds per snippet (RLIMIT_CPU).")
    memory_mib: int = Field(512, ge=64, le=65536, description="Address space per snippet in MiB (RLIMIT_AS); "
                            "an allocation past it fails in the snippet (MemoryError).")
    output_bytes: int = Field(65536, ge=1024, le=2**30, description="Most bytes of stdout, of stderr and of any "
                              "file a snippet writes (RLIMIT_FSIZE).")
    processes: int = Field(64, ge=8, le=4096, description="Most processes and threads of the snippet's user "
                           "(RLIMIT_NPROC; new processes are refused by the audit hook anyway).")


BuiltinEnvironment = Literal["calculator", "verifiers"]
"""The built-in environments (rlkube.core.actor.environments.BUILTIN_ENVIRONMENTS, which a unit test keeps equal):
a closed list, so the CRD's enum refuses any other name at the API server, before the job is stored. Both draw
their own prompts (`prompt(rng)`), so neither takes another prompt source (lifecycle/validation.py)."""


class EnvironmentSpec(Model):
    """A multi-turn environment (rlkube.core.actor.episodes): the model replies, the environment answers (tool results),
    the episode ends with a reward; trained on as one document of the exact tokens sampled."""

    name: BuiltinEnvironment | None = Field(
        None, description="A built-in environment: `calculator` (arithmetic with a calculator tool), or `verifiers` "
        "(a verifiers taskset, params.taskset its id; the `agents` extra). Your own environment: entryPoint."
    )
    entry_point: str | None = Field(
        None,
        pattern=ENTRY_POINT,
        description="Importable `package.module:factory` returning an environment (called with **params); "
        "instead of name.",
    )
    params: dict[str, Scalar] = Field(default_factory=dict, description="Parameters passed to the environment.")
    max_turns: int = Field(4, ge=1, le=1000, description="Most model replies per episode; an episode that would go "
                           "on is truncated (and counted).")
    max_episode_tokens: int | None = Field(
        None, ge=2, description="Most tokens per episode, prompt and environment turns included; an episode that "
        "would grow past it is truncated (and counted). Unset: model.maxSequenceLength when set, else no limit.")
    tool_timeout_seconds: float = Field(
        10.0, gt=0, le=3600, description="Seconds each environment answer (its tool calls) and the final scoring "
        "may take; past it the episode ends, is scored and counted as a tool timeout.")
    episode_timeout_seconds: float | None = Field(
        None, gt=0, le=86400, description="Seconds per episode, from its first reply to its last (tool calls and "
        "later turns; the final scoring has toolTimeoutSeconds); past it the episode is ended, scored by the "
        "environment (0 if that fails) and counted as truncated and timed out. Unset: no limit.")
    episode_reward: Literal["final", "sum"] = Field(
        "final", description="The episode's reward, from which its advantage is computed: `final` the "
        "environment's reward() (per-turn rewards are reported only), `sum` the per-turn rewards plus reward().")
    sandbox: SandboxSpec = Field(default_factory=SandboxSpec, description="The code-execution sandbox a factory "
                                 "gets by declaring a `sandbox` parameter (its `python_tool(code)`).")


class ReasoningGymSpec(Model):
    """Prompts generated by a reasoning-gym task (PyPI reasoning-gym, the `agents` extra), scored by its own
    `score_answer` (rlkube.core.actor.gym_tasks). Procedural: nothing is downloaded."""

    name: str = Field(
        ..., min_length=1, pattern=r"^[A-Za-z0-9_]+$",
        description="A reasoning-gym dataset name, e.g. basic_arithmetic, leg_counting, spell_backward "
        "(reasoning_gym.factory.DATASETS).",
    )
    config: dict[str, Scalar | list[Scalar]] = Field(
        default_factory=dict, description="The task's config fields (its dataclass, e.g. basic_arithmetic's "
        "min_terms, max_digits, operators), passed as they are; seed and size are set below.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Generator seed: the same seed draws the same prompts.")
    size: int = Field(
        10000, ge=1, le=10**9, description="Prompts per pass; after it the generator is reseeded (seed + "
        "passes x size) for new ones, and actor replicas take turns in the sequence.",
    )


class TaskSpec(Model):
    name: str = Field(
        "reverse-digits",
        min_length=1,
        description="A built-in task (see `rlkube tasks`) or, with entryPoint or dataset set, a label for the task.",
    )
    entry_point: str | None = Field(
        None,
        pattern=ENTRY_POINT,
        description="Importable `package.module:factory` returning a Task; overrides the built-in name.",
    )
    params: dict[str, Scalar] = Field(
        default_factory=dict, description="Task parameters passed to the task factory."
    )
    dataset: DatasetSpec | None = Field(
        None, description="Read prompts from a dataset instead of a built-in generator (needs `reward`, unless "
        "completionField makes it a supervised dataset)."
    )
    reward: RewardSpec | None = Field(
        None, description="Score completions with this reward instead of the task's own (required with dataset)."
    )
    reasoning_gym: ReasoningGymSpec | None = Field(
        None, description="Prompts from a reasoning-gym procedural task, scored by its own score_answer (unless "
        "reward is set); instead of the built-in name, entryPoint or dataset."
    )
    environment: EnvironmentSpec | None = Field(
        None, description="Multi-turn episodes: the model's replies answered by this environment (tools) until it "
        "scores the episode. Its own prompts, if it draws them, else the task's."
    )
    chat_template: bool | None = Field(
        None,
        description="Render prompts with the tokenizer's chat template. Unset: when the tokenizer has one, "
        "except for the raw-text digit tasks (reverse-digits, copy-digits).",
    )

    def prompt_sources(self) -> list[str]:
        """The fields that say where the prompts come from, as written (the built-in `name` is the source only
        when none is). A built-in environment draws its own prompts, so it is one; an entryPoint environment may
        take the task's, which only building it tells (the actor checks then). One is allowed
        (lifecycle/validation.py)."""
        env = self.environment
        return [field for field, given in (
            ("spec.task.environment.name", env is not None and env.name is not None),
            ("spec.task.dataset", self.dataset is not None),
            ("spec.task.reasoningGym", self.reasoning_gym is not None),
            ("spec.task.entryPoint", bool(self.entry_point)),
        ) if given]
