"""Signed store records: nothing written into the coordination store from outside the run is
evidence.

The store is a TCPStore: anyone who can reach its port can read and write any key, and its
address is in every worker's environment. So every record the kit acts on carries a MAC over
the store prefix, the key and the value, made with a
per-run secret that only the run's processes hold (keyed BLAKE2b, 128 bits)::

    value + "." + fingerprint (8 hex) + mac (32 hex)

The fingerprint names the secret (a hash of it, not the secret), so that a rank started with
another secret, or by a build that does not sign, is told apart from a forger and stopped with
a one-line error (exit 2) instead of waiting for records it can never accept. Appended lists
(keys ending in ``/listed``) hold one signed item per line.

Where the secret comes from (:func:`run_secret`):

* ``DDP_SMOKE_SECRET`` (64 hex digits), set by the launcher that starts the run: the sbatch
  script, the image's entrypoint, ``submit``, ``make smoke-local``. Environments are readable
  only by the job's user and root.
* Otherwise, when every rank runs on this node (``WORLD_SIZE == LOCAL_WORLD_SIZE``), the first
  local rank draws one and the others read it from a file that only this user can read (mode
  0600 in a 0700 folder of the user's own under the temporary folder; a file or folder owned by
  anyone else is refused). Rank 0 removes it once every rank has connected.
* Otherwise (several nodes, no secret) the run is unsigned: it runs as before, the report says
  ``security.signed: false`` and ``--act`` acts on nothing.

Threat model: other users on the network or on the nodes, who can reach the store's port but
cannot read the job's environment or the user's files. Root and the job's own user can read
the secret (as they can ptrace the workers); the process group's own traffic and torchrun's
rendezvous keys are PyTorch's and stay unauthenticated. Deleting or overwriting records cannot
be prevented (the store has no access control): that can stop a run or hide a rank's record,
which then reads as missing; it cannot put words in a rank's mouth.

Readers treat a record that fails its check as absent, and it is recorded as a finding
(key, claimed rank, why), which every rank posts to the signed list ``security/listed`` and the
report's writer reads back for the report's ``security`` section.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import tempfile
import threading
import time

from .. import redact
from ..errors import ConfigError
from . import keys

ENV = "DDP_SMOKE_SECRET"
SECURITY = keys.listed(keys.SECURITY)
HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_TAIL = re.compile(rb"^[0-9a-f]{40}$")
_MAX_FINDINGS = 100  # a flood of forgeries is reported, not stored without end
WHY = {"unsigned": "not signed, written by something that does not sign",
       "other": "signed with another secret",
       "forged": "signed wrongly, written or altered outside the run",
       "signed": "signed, and this rank has no secret (no DDP_SMOKE_SECRET here)"}
_HINT = (f"every rank needs the same {ENV} (64 hex digits, one per run, e.g. `openssl rand -hex "
         "32`) and the same ddp-smoke version; the kit's launchers set it")

_lock = threading.Lock()
_findings: dict[tuple[str, str], dict] = {}
_local_file: str | None = None  # this node's secret file, while it exists


def _forked() -> None:
    """In a rank forked from a launcher that reads the store too: a fresh lock and findings."""
    global _lock
    _lock = threading.Lock()
    _findings.clear()


os.register_at_fork(after_in_child=_forked)


# -- the secret -------------------------------------------------------------------------------

def run_secret(env, environ=os.environ) -> bytes | None:
    """This run's secret (see the module doc), or None for an unsigned multi-node run.
    A malformed ``DDP_SMOKE_SECRET``, or a secret file that is not this user's alone, is a
    ConfigError (one line, exit 2). The variable is removed from this process's environment
    once read: nothing started later inherits it."""
    global _local_file
    given = environ.pop(ENV, None)
    if given is not None:
        if not HEX64.match(given):
            raise ConfigError(f"{ENV}: expected 64 hex digits (32 random bytes, e.g. `openssl "
                              f"rand -hex 32`), got {len(given)} characters")
        return _remember(bytes.fromhex(given))
    if env.world_size != env.local_world_size:
        return None
    _local_file = _node_file(env, environ)
    return _remember(_read_or_make(_local_file))


def _remember(secret: bytes) -> bytes:
    redact.forget_value(secret.hex())  # the report's redaction knows the value itself
    return secret


def _node_file(env, environ) -> str:
    """The path every local rank of this run computes alike: the store's address and the
    launcher's ids, hashed (no other run on this node has the same store port now)."""
    ids = [env.master_addr, str(env.master_port)] + [environ.get(k, "") for k in (
        "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "DDP_SMOKE_RUN_ID", "SLURM_JOB_ID",
        "SLURM_STEP_ID")]
    name = hashlib.sha256("\0".join(ids).encode()).hexdigest()[:24]
    folder = os.path.join(tempfile.gettempdir(), f"ddp-smoke-{os.getuid()}")
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"{folder}: cannot make the folder for this node's run secret "
                          f"({e.strerror}); or set {ENV}") from None
    _private(folder, os.lstat(folder), stat.S_ISDIR)
    return os.path.join(folder, f"{name}.secret")


def _private(path: str, st: os.stat_result, kind) -> None:
    if not kind(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{path}: not this user's alone (owner uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):o}): refusing to take the run's secret "
                          f"from it; remove it, or set {ENV}")


def _read_or_make(path: str, wait_s: float = 10.0) -> bytes:
    """The secret in ``path``; the first rank to come makes it (written to a private temporary
    file, then linked into place: a reader never sees half a secret)."""
    end = time.monotonic() + wait_s
    while True:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            fd = None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read this node's run secret ({e.strerror})") \
                from None
        if fd is not None:
            with os.fdopen(fd, "rb") as f:
                _private(path, os.fstat(f.fileno()), stat.S_ISREG)
                text = f.read().decode("ascii", "replace")
            if HEX64.match(text):
                return bytes.fromhex(text)
        else:
            tmp_fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))  # mode 0600
            try:
                os.write(tmp_fd, secrets.token_hex(32).encode())
                os.close(tmp_fd)
                os.link(tmp, path)  # fails if another rank was first: read theirs
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
            continue
        if time.monotonic() > end:
            raise ConfigError(f"{path}: holds no secret; remove it, or set {ENV}")
        time.sleep(0.05)


def forget_local_secret() -> None:
    """Rank 0, once every rank has connected (each read the node's secret before it did):
    remove this node's secret file. Nothing to do for a launcher-given secret."""
    global _local_file
    if _local_file:
        try:
            os.unlink(_local_file)
        except OSError:
            pass
        _local_file = None


def fingerprint(secret: bytes) -> bytes:
    """Names the secret without revealing it: 32 bits of a hash, for error messages."""
    return hashlib.sha256(b"ddp-smoke secret fingerprint\0" + secret).hexdigest()[:8].encode()


# -- the store ------------------------------------------------------------------------------

class SignedStore:
    """The harness's view of its store connection: signs what it writes, checks what it
    reads. Same calls as the c10d store it wraps (``raw``), same keys, byte for byte.

    * ``get`` and ``multi_get`` return genuine values; a key holding a record that fails its
      check reads as absent, so, as for an absent key, they wait for the genuine one (up to
      the store's timeout). ``peek`` never waits: None for a record that fails.
    * ``compare_set`` treats a failing record as absent (it is replaced).
    * ``append`` signs each item; ``get`` of a list returns its genuine items.
    * ``add`` counts, unsigned (the store adds integers): no counter is evidence.
    * ``check`` and ``wait`` see keys, not records: what they tell is timing, never evidence.
    """

    def __init__(self, raw, scope: str, secret: bytes | None, rank: int):
        self.raw, self.rank = raw, rank
        self._scope = scope.encode() + b"/"
        self._secret = secret
        self._fp = fingerprint(secret) if secret else None

    def __getattr__(self, name):
        """The store's other calls and attributes (``timeout``, ``num_keys`` …) as they are."""
        return getattr(self.raw, name)

    @property
    def signed(self) -> bool:
        return self._secret is not None

    # -- sealing and opening
    def _mac(self, key: str, value: bytes) -> bytes:
        # Keyed BLAKE2b is a MAC by design (RFC 7693; no HMAC construction needed) and 2.5x
        # cheaper than HMAC-SHA256 here (0.7 against 1.8 us a record): blame and the
        # gather check 4,096 records at once.
        return hashlib.blake2b(self._scope + key.encode() + b"\0" + value, key=self._secret,
                               digest_size=16).hexdigest().encode()

    def seal(self, key: str, value) -> bytes:
        v = value.encode() if isinstance(value, str) else bytes(value)
        return v if self._secret is None else v + b"." + self._fp + self._mac(key, v)

    def open(self, key: str, raw: bytes) -> tuple[bytes | None, str | None]:
        """``(value, None)`` for a genuine record, ``(None, why)`` otherwise."""
        cut = len(raw) - 41  # where the "." before fingerprint and mac would be
        if self._secret is not None and cut >= 0 and raw[cut + 1:cut + 9] == self._fp:
            # the common case first, and fast: 4,096 records are read at once (blame, gather)
            value = raw[:cut]
            if raw[cut:cut + 1] == b"." and hmac.compare_digest(raw[cut + 9:],
                                                                 self._mac(key, value)):
                return value, None
            return None, "forged"
        looks_signed = cut >= 0 and raw[cut:cut + 1] == b"." and bool(_TAIL.match(raw[cut + 1:]))
        if self._secret is None:
            return (None, "signed") if looks_signed else (raw, None)
        return None, ("other" if looks_signed else "unsigned")

    def _open_list(self, key: str, raw: bytes) -> bytes:
        if self._secret is None:
            return raw
        out = []
        for line in raw.split(b"\n"):
            if line:
                value, why = self.open(key, line)
                if why is None:
                    out.append(value)
                else:
                    self.note(key, line, why)
        return b"".join(out)

    def _genuine(self, key: str, raw: bytes) -> bytes | None:
        if key.endswith("/listed"):
            return self._open_list(key, raw)
        value, why = self.open(key, raw)
        if why is not None:
            self.note(key, raw, why)
        return value

    # -- writing
    def set(self, key: str, value) -> None:
        self.raw.set(key, self.seal(key, value))

    def multi_set(self, keys: list[str], values: list) -> None:
        self.raw.multi_set(keys, [self.seal(k, v) for k, v in zip(keys, values)])

    def append(self, key: str, value) -> None:
        piece = self.seal(key, value)
        # One item per line, a line break on both sides: junk appended without one cannot
        # run into the next genuine item.
        self.raw.append(key, piece if self._secret is None else b"\n" + piece + b"\n")

    def compare_set(self, key: str, expected, desired) -> bytes:
        """Only ``expected=""`` (set when absent) is used: returns the genuine value that
        stands, ``desired`` when it was set. A failing record counts as absent: replaced."""
        assert expected in ("", b""), "only set-when-absent is signed"
        sealed = self.seal(key, desired)
        current = self.raw.compare_set(key, "", sealed)
        for _ in range(16):  # a forger racing us would have to win every round
            if current == sealed:
                return desired.encode() if isinstance(desired, str) else bytes(desired)
            value, why = self.open(key, current)
            if why is None:
                return value
            self.note(key, current, why)
            current = self.raw.compare_set(key, current, sealed)
        raise TimeoutError(f"{key}: replaced again and again by a writer outside the run")

    def add(self, key: str, amount: int) -> int:
        return self.raw.add(key, amount)

    # -- reading
    def check(self, keys) -> bool:
        return self.raw.check(keys)

    def wait(self, keys, timeout=None, **waiting) -> None:
        if waiting:  # a Connection's sliced wait (coordination/store.py)
            return self.raw.wait(keys, timeout, **waiting)
        return self.raw.wait(keys) if timeout is None else self.raw.wait(keys, timeout)

    def peek(self, keys: list[str]) -> list[bytes | None]:
        """The genuine value of each key (all must exist), None where a record fails its
        check. Never waits for a genuine record."""
        return [self._genuine(k, v) for k, v in zip(keys, self.raw.multi_get(keys))]

    def get(self, key: str, **waiting) -> bytes:
        """The genuine value at ``key`` (``waiting``: a Connection's sliced blocking read)."""
        value = self._genuine(key, self.raw.get(key, **waiting)) if waiting else None
        return value if value is not None else self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        got = self.peek(keys)
        bad = [i for i, v in enumerate(got) if v is None]
        if bad:  # absent, as far as we are concerned: wait for the genuine records, bounded
            # beyond the stage's deadline (the store's timeout is the run's): the watchdog acts
            # first, and a forger's record never becomes this rank's own error
            end = time.monotonic() + 2 * self.raw.timeout.total_seconds()
            pause = 0.01
            while bad:
                if time.monotonic() > end:
                    import torch.distributed as dist
                    raise dist.DistStoreError(
                        f"no genuine record within the store's timeout under "
                        f"{', '.join(keys[i] for i in bad[:3])}: written outside the run")
                time.sleep(pause)
                pause = min(2 * pause, 0.25)
                for i, v in zip(bad, self.peek([keys[i] for i in bad])):
                    got[i] = v
                bad = [i for i in bad if got[i] is None]
        return got

    # -- findings
    def note(self, key: str, raw: bytes, why: str) -> None:
        """Record a record that failed its check (once per key and reason), and post it for
        the report's writer. Never raises."""
        with _lock:
            if (key, why) in _findings or len(_findings) >= _MAX_FINDINGS:
                return
            finding = {"key": key, "rank": _claimed_rank(key, raw), "why": WHY[why],
                       "seen_by": self.rank,
                       "value": raw[:120].decode("utf-8", "replace")}
            _findings[(key, why)] = finding
        try:
            self.append(SECURITY, json.dumps(finding))
        except Exception:  # noqa: BLE001 — the store may be going; the local list stands
            pass


_RANK0 = (keys.of(keys.RESULT, ""), keys.of(keys.NEXT, ""), keys.RUN_ID, keys.BACKEND,
          keys.FINAL, keys.WRITER)  # rank 0's (or the writer's)


def _claimed_rank(key: str, raw: bytes) -> int | None:
    """The rank a record claims to be from: rank 0 for what only it writes, a per-rank key's
    last part, a listed item's rank, or the ``rank`` of its JSON."""
    if key.startswith(_RANK0) or key.endswith("/all"):
        return 0
    last = key.rsplit("/", 1)[-1]
    if last.isdigit():
        return int(last)
    text = raw.decode("utf-8", "replace")
    head = text.split(",", 1)[0].strip()
    if key.endswith("/listed") and head.isdigit():
        return int(head)
    try:
        rank = json.loads(text.rpartition(".")[0] or text).get("rank")
    except (ValueError, AttributeError):
        try:
            rank = json.loads(text).get("rank")
        except (ValueError, AttributeError):
            return None
    return rank if isinstance(rank, int) else None


def wrap(raw, scope: str, env, environ=os.environ) -> SignedStore:
    """The harness's store: ``raw`` (a PrefixStore named ``scope``) signed with this run's
    secret (:func:`run_secret`, read once per process)."""
    global _secret_read
    if _secret_read is None:
        _secret_read = (run_secret(env, environ),)
    return SignedStore(raw, scope, _secret_read[0], env.rank)


_secret_read: tuple[bytes | None] | None = None


def peers(store: SignedStore, keys: list[str]) -> list[bytes]:
    """The first records read from other ranks (rank 0: every rank's ``connect``; the others:
    rank 0's): the genuine values. A record signed with another secret, or one that is not
    signed where ours are (or the reverse), is a rank of another build or configuration: a
    ConfigError now, not a wait for records it can never write. A forged one is waited out."""
    raw = store.raw.multi_get(keys)
    for key, value in zip(keys, raw):
        why = store.open(key, value)[1]
        if why in ("unsigned", "other", "signed"):
            who = f"rank {key.rsplit('/', 1)[-1]}" if key.startswith("connect/") else "rank 0"
            mine = ("" if why == "signed" else
                    f", this rank's with its own (fingerprint {store._fp.decode()})")
            raise ConfigError(f"{who}'s records are {WHY[why]}{mine}: {_HINT}")
    return store.multi_get(keys)


def findings(store: SignedStore | None) -> list[dict]:
    """Every finding of the run that reached this process: its own and those the other ranks
    posted. Never raises."""
    with _lock:
        out = list(_findings.values())
    try:
        if store is not None and store.check([SECURITY]):
            out += _split_json(store.peek([SECURITY])[0].decode())
    except Exception:  # noqa: BLE001
        pass
    seen, unique = set(), []
    for f in out:  # once per record and reason, however many ranks saw it
        k = (f.get("key"), f.get("why"))
        if k not in seen:
            seen.add(k)
            unique.append(f)
    return unique


def _split_json(text: str) -> list[dict]:
    """The JSON objects of a list's genuine items, joined without separators."""
    out, dec, i = [], json.JSONDecoder(), 0
    while i < len(text):
        try:
            obj, i = dec.raw_decode(text, i)
        except ValueError:
            break
        if isinstance(obj, dict):
            out.append(obj)
    return out


def section(store: SignedStore | None) -> dict:
    """The report's ``security`` section."""
    signed = bool(store is not None and store.signed)
    return {"signed": signed, "findings": findings(store)}


def _reset_for_tests() -> None:
    global _secret_read, _local_file
    with _lock:
        _findings.clear()
    _secret_read, _local_file = None, None

