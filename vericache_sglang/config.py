"""VeriCache's settings: one dataclass, the CLI flags derived from it, and their validation.

The same fields arrive as `--vericache-*` flags on `sglang.launch_server` and as
`vericache_*` keyword arguments of `sglang.Engine`; both go through `VeriCacheConfig.build`, so
a bad value gets the same one-line message either way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

FULL_TIER_PLACEMENTS = ("auto", "device", "host", "disk")
DRAFTERS = ("auto", "none", "ngram", "model")
STORE_READS = ("always", "auto")

MAX_DRAFTER_LENGTH = 32
"""The most tokens a level-2 drafter may propose per check: one check forward over the
compressed tier runs that many + 1 tokens per request."""

MAX_DRAFT_LENGTH = 256
"""The longest draft a round may make. A round verifies up to this + 1 tokens per request, and
SGLang reserves twice that many KV slots ahead of every running request for each step."""

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*$", re.IGNORECASE)
_SIZE_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


# Where a server's settings ride: not a ServerArgs field but a bookkeeping attribute, which
# ServerArgs pickles to the scheduler process with the record and leaves writable after
# resolution.
CONFIG_ATTR = "_vericache"


class VeriCacheConfigError(ValueError):
    """An invalid VeriCache setting; the message is the one line the user sees."""


def parse_size(text: str) -> int:
    """Bytes from a size such as `512MB`, `8GiB`, `1.5G` or `1000000`.

    K/M/G/T are decimal (1000^n), Ki/Mi/Gi/Ti binary (1024^n), as in Kubernetes quantities.
    """
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"{text!r} is not a size (examples: 512MiB, 8GiB, 2G, 1000000)")
    number, unit = float(match.group(1)), (match.group(2) or "").lower()
    base = 1024 if unit.endswith("i") else 1000
    return int(number * base ** _SIZE_POWERS[unit[:1]])


def _validated_compressor(spec: str) -> str:
    from vericache_sglang.compress import CompressorSpecError, parse_compressor_spec

    try:
        return parse_compressor_spec(spec).spec()
    except CompressorSpecError as e:
        raise VeriCacheConfigError(f"--vericache-compressor: {e}") from None


@dataclass(frozen=True)
class VeriCacheConfig:
    """Resolved VeriCache settings. Each field's `help` metadata is its `--help` text."""

    enable_vericache: bool = field(
        default=False,
        metadata={
            "help": "Serve lossless: draft tokens on a compressed KV tier kept on the device, "
            "verify them in one forward over the full-precision KV. Output equals plain SGLang."
        },
    )
    vericache_compressor: str = field(
        default="kivi:bits=4,group=32,residual=128",
        metadata={
            "help": "How the compressed tier is made, as METHOD:key=value,... ; '+' composes "
            "(e.g. 'snapkv:ratio=0.5+kivi:bits=4'). Methods: kivi (quantization), streaming, "
            "snapkv, h2o (token dropping).",
        },
    )
    vericache_draft_length: int = field(
        default=16,
        metadata={"help": "Draft tokens per verification round of the first rounds at a "
                  "batch size, before the rounds' measured cost chooses the length."},
    )
    vericache_min_draft_length: int = field(
        default=4,
        metadata={"help": "Smallest non-zero draft length the cost-based choice takes (a plain "
                  "step, no drafts, is always one of its choices; equal to the maximum: every "
                  "round drafts that length)."},
    )
    vericache_max_draft_length: int = field(
        default=64,
        metadata={"help": "Largest draft length the cost-based choice takes."},
    )
    vericache_drafter: str = field(
        default="auto",
        metadata={
            "help": "A cheaper drafter under the compressed-KV one (level 2). 'ngram': SGLang's "
            "n-gram corpus proposes continuations seen earlier in the request (its prompt "
            "included) or in other requests; the model over the compressed tier checks each "
            "proposal in one forward and keeps what it agrees with, and the full KV verifies "
            "as always. Suits code, agent traces and long documents, which repeat their "
            "context. 'model': the small model --vericache-draft-model names. A request with a "
            "grammar has its proposals checked under the grammar's mask at each position. "
            "'none': one token per drafting forward. 'auto' (the default): 'model' with "
            "--vericache-draft-model, else 'ngram', which was at least as fast as 'none' on "
            "code and chat at batch 1 and 4 in the measured runs (docs/drafting.md).",
            "choices": DRAFTERS,
        },
    )
    vericache_draft_model: str | None = field(
        default=None,
        metadata={
            "help": "A small model directory (Hugging Face format, the target's tokenizer) as "
            "the level-2 drafter: it decodes greedily on a KV cache of its own, on the "
            "target's device and dtype, and sets --vericache-drafter model. A "
            "draft_vocab.json beside its config.json ({\"token_ids\": [...]}) limits its head "
            "to those tokens.",
        },
    )
    vericache_drafter_min_length: int = field(
        default=1,
        metadata={"help": "Lower bound of the level-2 drafter's adaptive proposal length."},
    )
    vericache_drafter_max_length: int = field(
        default=8,
        metadata={"help": "Upper bound (and initial value) of the level-2 drafter's adaptive "
                  f"proposal length, at most {MAX_DRAFTER_LENGTH}."},
    )
    vericache_full_tier: str = field(
        default="auto",
        metadata={
            "help": "Where the full-precision KV lives. 'device': in SGLang's own KV pool "
            "beside the compressed pool. 'host': in host memory; the device keeps the "
            "compressed pool, drafting windows and a staging area that verification streams "
            "the full KV through, layer by layer, while drafting runs (served on CPUs; its "
            "copy engine passed the device check on a GPU, the server path has not run "
            "there). 'disk': as 'host', and pages the "
            "radix tree evicts from host memory go to files through SGLang's hierarchical "
            "cache (--vericache-disk-dir), each with a digest checked when it is read back. "
            "'auto': 'device' on a GPU and on a CPU (where device and host memory are the same "
            "RAM, so the host tier saves nothing and costs a copy per verification: see "
            "docs/memory.md), 'host' when SGLang's hierarchical cache has a storage backend "
            "(one host pool) or a host budget is given; the startup log says which and why.",
            "choices": FULL_TIER_PLACEMENTS,
        },
    )
    vericache_full_tier_budget: int | None = field(
        default=None,
        metadata={
            "help": "Most bytes the host full tier may hold, e.g. 8GiB or 512MB (K/M/G "
            "decimal, Ki/Mi/Gi binary); by default as many tokens as the compressed pool "
            "covers. Only with --vericache-full-tier host or disk.",
            "parse": parse_size,
        },
    )
    vericache_disk_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory of the disk tier's page files (default: SGLang's file backend "
            "directory, $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR or /tmp/hicache). Only with "
            "--vericache-full-tier disk.",
        },
    )
    vericache_staging_budget: int | None = field(
        default=None,
        metadata={
            "help": "Device bytes of the staging area verification reads the host full tier "
            "through, a size like --vericache-full-tier-budget; at least two units of one "
            "layer of a full-context request (default: four units). Only with "
            "--vericache-full-tier host or disk.",
            "parse": parse_size,
        },
    )
    vericache_store_reads: str = field(
        default="always",
        metadata={
            "help": "With a KV store (--hicache-storage-backend, or --vericache-full-tier disk): "
            "'always' reads every stored page of a prompt's prefix; 'auto' measures how long "
            "this server takes to read a stored page (transfer and decode) and to prefill a "
            "token, and recomputes a stored prefix when reading it would take longer, as "
            "CacheGen does on a slow link (the choice is logged and counted in "
            "vericache:store_reads_declined; output is the same either way).",
            "choices": STORE_READS,
        },
    )
    vericache_store_codec_processes: int = field(
        default=0,
        metadata={
            "help": "Child processes that code a KV store's pages (CacheGen streams) side by "
            "side, so a store's read (Mooncake or file) decodes several pages at once and a "
            "prefix's decode keeps up with its link; 0: one per CPU core, at most 4. Each child "
            "costs about 0.3 GB of private host memory and no device memory.",
        },
    )
    vericache_store_timeout: float = field(
        default=30.0,
        metadata={
            "help": "Seconds a KV store's page may wait on a codec process "
            "(--vericache-store-codec-processes) that makes no progress taking the page or "
            "answering, and with --vericache-early-drafting the longest a prefill waits for its "
            "stored prefix's exact KV. Past it a hung process is killed and replaced, and the "
            "page counts as failed (vericache:disk_faults kind timeout, "
            "vericache:early_exact_timed_out): its prefix is recomputed, with the same output.",
        },
    )

    vericache_early_drafting: bool = field(
        default=False,
        metadata={
            "help": "With a Mooncake store (--hicache-storage-backend mooncake, --page-size a "
            "multiple of 64, a KIVI compressor without a recent band): answer SGLang's prefetch "
            "once a stored page's drafting level (about a fifth of a float32 page) has arrived, "
            "and fetch its exact part behind it; a request whose prefix comes from the store "
            "drafts over the compressed KV while the exact KV arrives, and its first output "
            "token comes from a forward over the exact KV (lossless). Counted in "
            "/server_info vericache_state.early_drafting.",
        },
    )

    vericache_drafting_deadline: float = field(
        default=1.0,
        metadata={
            "help": "With --vericache-early-drafting: seconds from the start of a store read "
            "by which its drafting level should be in. Each page fetches the compressed pool's "
            "level where the bandwidth measured on the objects already received allows it, "
            "else only a coarser level (0.7 of the bytes), whose codes the pool level's "
            "replace when the page's exact part arrives (CacheGen's adaptation to the link). "
            "0: always the coarse level first. The choice and the link's rate are logged, on "
            "/metrics (vericache:store_pages form=coarse, vericache:store_link_mbit) and in "
            "/server_info.",
        },
    )

    def __post_init__(self) -> None:
        for name in ("vericache_draft_length", "vericache_min_draft_length",
                     "vericache_max_draft_length"):
            if getattr(self, name) < 1:
                raise VeriCacheConfigError(
                    f"{_flag(name)} must be a positive integer, got {getattr(self, name)}"
                )
        if not (self.vericache_min_draft_length <= self.vericache_draft_length
                <= self.vericache_max_draft_length):
            raise VeriCacheConfigError(
                "draft lengths must satisfy --vericache-min-draft-length <= "
                "--vericache-draft-length <= --vericache-max-draft-length, got "
                f"{self.vericache_min_draft_length} <= {self.vericache_draft_length} <= "
                f"{self.vericache_max_draft_length}"
            )
        if self.vericache_max_draft_length > MAX_DRAFT_LENGTH:
            raise VeriCacheConfigError(
                f"--vericache-max-draft-length must be at most {MAX_DRAFT_LENGTH} (a round "
                "verifies that many + 1 tokens per request, and SGLang reserves twice as many "
                f"KV slots ahead of every running request), got {self.vericache_max_draft_length}")
        if self.vericache_drafter not in DRAFTERS:
            raise VeriCacheConfigError(
                f"--vericache-drafter must be one of {', '.join(DRAFTERS)}, "
                f"got {self.vericache_drafter!r}")
        self._resolve_draft_model()
        low, high = self.vericache_drafter_min_length, self.vericache_drafter_max_length
        if not 1 <= low <= high <= MAX_DRAFTER_LENGTH:
            raise VeriCacheConfigError(
                "drafter lengths must satisfy 1 <= --vericache-drafter-min-length <= "
                f"--vericache-drafter-max-length <= {MAX_DRAFTER_LENGTH}, got {low} and {high}")
        defaults = (type(self).vericache_drafter_min_length,
                    type(self).vericache_drafter_max_length)
        if self.vericache_drafter == "none" and (low, high) != defaults:
            raise VeriCacheConfigError(
                "--vericache-drafter-min-length and --vericache-drafter-max-length bound a "
                "level-2 drafter; they do nothing with --vericache-drafter none")
        if self.vericache_store_reads not in STORE_READS:
            raise VeriCacheConfigError(
                f"--vericache-store-reads must be one of {', '.join(STORE_READS)}, "
                f"got {self.vericache_store_reads!r}")
        if self.vericache_store_codec_processes < 0:
            raise VeriCacheConfigError(
                "--vericache-store-codec-processes must be 0 (one per CPU core) or more, got "
                f"{self.vericache_store_codec_processes}")
        if not 0 < self.vericache_store_timeout < float("inf"):
            raise VeriCacheConfigError(
                "--vericache-store-timeout must be a positive number of seconds, got "
                f"{self.vericache_store_timeout}")
        if not self.vericache_drafting_deadline >= 0:
            raise VeriCacheConfigError(
                "--vericache-drafting-deadline must be 0 or more seconds, got "
                f"{self.vericache_drafting_deadline}")
        if (not self.vericache_early_drafting
                and self.vericache_drafting_deadline != type(self).vericache_drafting_deadline):
            raise VeriCacheConfigError(
                "--vericache-drafting-deadline times the drafting level of an early-drafting "
                "read; it does nothing without --vericache-early-drafting")
        if self.vericache_full_tier not in FULL_TIER_PLACEMENTS:
            raise VeriCacheConfigError(
                f"--vericache-full-tier must be one of {', '.join(FULL_TIER_PLACEMENTS)}, "
                f"got {self.vericache_full_tier!r}"
            )
        for name in ("vericache_full_tier_budget", "vericache_staging_budget"):
            if getattr(self, name) is not None and not self.host_placement:
                raise VeriCacheConfigError(
                    f"{_flag(name)} sizes the host placement; it does nothing with "
                    f"--vericache-full-tier {self.vericache_full_tier}")
        if self.vericache_disk_dir is not None and self.vericache_full_tier != "disk":
            raise VeriCacheConfigError(
                "--vericache-disk-dir places the disk tier; it does nothing with "
                f"--vericache-full-tier {self.vericache_full_tier}")
        object.__setattr__(
            self, "vericache_compressor", _validated_compressor(self.vericache_compressor)
        )

    def _resolve_draft_model(self) -> None:
        """--vericache-draft-model selects the model drafter; a model drafter needs one;
        'auto' is the model drafter with one, the n-gram corpus without."""
        path = self.vericache_draft_model
        if path is None:
            if self.vericache_drafter == "model":
                raise VeriCacheConfigError(
                    "--vericache-drafter model needs --vericache-draft-model PATH")
            if self.vericache_drafter == "auto":
                object.__setattr__(self, "vericache_drafter", "ngram")
            return
        if self.vericache_drafter in ("ngram", "none"):
            raise VeriCacheConfigError(
                "--vericache-draft-model is a level-2 drafter of its own; it cannot be combined "
                f"with --vericache-drafter {self.vericache_drafter}")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise VeriCacheConfigError(
                f"--vericache-draft-model: {path} is not a model directory (no config.json)")
        object.__setattr__(self, "vericache_drafter", "model")

    @property
    def host_placement(self) -> bool:
        """The full KV pool lives in host memory ('host', and 'disk' which spills below it).
        Before startup resolves 'auto' (`tiers/placement.py`), 'auto' admits the host flags."""
        return self.vericache_full_tier != "device"

    @classmethod
    def build(cls, values: dict[str, Any]) -> VeriCacheConfig:
        """Make a config from raw values (strings from the CLI or Python values from Engine).

        Unset (None) values take their defaults. Setting `--vericache-*` options without
        `--enable-vericache` is an error rather than a silent no-op.
        """
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = values.get(f.name)
            if raw is None:
                continue
            kwargs[f.name] = _convert(f, raw)
        if not kwargs.get("enable_vericache") and len(kwargs) > ("enable_vericache" in kwargs):
            given = sorted(_flag(k) for k in kwargs if k != "enable_vericache")
            raise VeriCacheConfigError(f"{', '.join(given)} given without --enable-vericache")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The settings as `/server_info` reports them, under their field names."""
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _convert(f: dataclasses.Field, raw: Any) -> Any:
    parse = f.metadata.get("parse")
    try:
        if parse is not None:
            return parse(raw) if isinstance(raw, str) else int(raw)
        if f.type in ("bool", bool):
            return _parse_bool(raw)
        if f.type in ("int", int):
            if isinstance(raw, int) and not isinstance(raw, bool):
                return raw
            if isinstance(raw, str) and raw.strip().lstrip("+-").isdigit():
                return int(raw)
            raise ValueError(f"{raw!r} is not an integer")
        if f.type in ("float", float):
            if isinstance(raw, bool):
                raise ValueError(f"{raw!r} is not a number")
            try:
                return float(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{raw!r} is not a number") from None
        return str(raw)
    except ValueError as e:
        raise VeriCacheConfigError(f"{_flag(f.name)}: {e}") from None


def _parse_bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{raw!r} is not a boolean")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the `--enable-vericache` / `--vericache-*` flags as one help group.

    Values are kept as given (default None) and validated by `VeriCacheConfig.build`, so an
    error is one line naming the flag, not argparse's usage dump of every SGLang flag.
    """
    group = parser.add_argument_group("VeriCache (lossless drafting on a compressed KV tier)")
    for f in dataclasses.fields(VeriCacheConfig):
        if f.type in ("bool", bool):
            group.add_argument(_flag(f.name), action="store_true", default=None,
                               help=f.metadata["help"])
            continue
        # A field without a default value says in its help what happens when it is unset.
        help_text = (f.metadata["help"] if f.default is None
                     else f"{f.metadata['help']} (default: {f.default})")
        if "choices" in f.metadata:
            help_text += f" Choices: {', '.join(f.metadata['choices'])}."
        group.add_argument(_flag(f.name), type=str, default=None, metavar=f.name[10:].upper(),
                           help=help_text.replace("%", "%%"))


def option_names() -> tuple[str, ...]:
    """The field names that also serve as `sglang.Engine` keyword arguments."""
    return tuple(f.name for f in dataclasses.fields(VeriCacheConfig))


def get_config(server_args: Any) -> VeriCacheConfig:
    """The VeriCache settings a server or engine was started with (defaults if none given)."""
    return getattr(server_args, CONFIG_ATTR, None) or VeriCacheConfig()


def attach_config(server_args: Any, config: VeriCacheConfig) -> None:
    """Record `config` on a server-args record (see `CONFIG_ATTR`)."""
    setattr(server_args, CONFIG_ATTR, config)


def served_config() -> VeriCacheConfig:
    """The VeriCache settings of the server this process runs (SGLang publishes its arguments
    in each scheduler process); the defaults (VeriCache off) in any other process."""
    from sglang.srt.runtime_context import get_server_args

    try:
        return get_config(get_server_args())
    except ValueError:  # "Global server args is not set yet!": not a server process
        return VeriCacheConfig()
