"""The Hub's transport as this tool uses it: the repo id's form, the token, one cheap request that proves
the Hub is reachable and the token valid (``connect``), bounded timeouts and retry budgets for
huggingface_hub's HTTP client and Xet (``bound_library``), and retries of what retrying can fix, with
one-line errors classified by the library's exception types (``with_retries``).

The token is handed to the library only: never printed, logged or written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlparse

import httpx2  # huggingface_hub's transport: its exception types say what happened on the wire
from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import (
    DisabledRepoError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import get_session, parse_ratelimit_headers, set_client_factory, validate_repo_id

from . import filenames
from .errors import ConvertError

T = TypeVar("T")
#: Statuses a later attempt can get past: a timeout, a rate limit, the server's own trouble.
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
#: Attempts of one step. Inside one, the requests the library sends through its http_backoff (preupload,
#: LFS, tree pages) have each been tried up to 6 times already: this outer loop is kept short.
MAX_ATTEMPTS = 4
#: The longest Retry-After worth waiting for in-process: the Hub's rate-limit window (5 minutes).
MAX_WAIT = 300.0
#: Seconds to open a connection (and for the probe's answer): the library's own DEFAULT_REQUEST_TIMEOUT.
CONNECT_TIMEOUT = float(os.environ.get("KIMI_CONVERT_CONNECT_TIMEOUT", "10"))
#: Seconds without a byte before a transfer counts as dropped, then retried: hf_xet's own read timeout.
IDLE_TIMEOUT = 300.0
#: Seconds a metadata request (a repository's info and listing, config.json, the index, a shard header's ranges)
#: may wait for its answer before the step fails in one line: these are small answers a working Hub gives in
#: well under a second, so a server that accepts the connection and sends nothing is not waited on for minutes.
METADATA_TIMEOUT_ENV = "KIMI_CONVERT_HUB_METADATA_TIMEOUT"
METADATA_TIMEOUT_DEFAULT = 30.0
IGNORE = [filenames.JOURNAL, filenames.LOCK, filenames.RAY_PROBE, "*.partial", ".cache/*"]
RESUME = "re-run the same command to resume (files already uploaded are skipped)"
NO_TOKEN = ("no Hugging Face token: pass --token, set HF_TOKEN, or run `hf auth login` (a token with write "
            "access: https://huggingface.co/settings/tokens)")


def metadata_timeout() -> float:
    """The metadata requests' bound (``KIMI_CONVERT_HUB_METADATA_TIMEOUT`` seconds, default 30)."""
    raw = os.environ.get(METADATA_TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else METADATA_TIMEOUT_DEFAULT
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise ConvertError(f"{METADATA_TIMEOUT_ENV}={raw}: expected a positive number of seconds")
    return value


class MetadataStall(ConvertError):
    """A metadata request unanswered within its bound: final (neither the library's retries of a timeout nor
    ours run again: the request hook raises this before the next attempt is sent)."""


@dataclass
class _Step:
    """A metadata step in progress on one thread."""

    bound: float
    started: float
    what: str
    repo_id: str
    answered: bool = False  # a response came (an error status too): the bound is on silence only


_metadata = threading.local()  # .step: the _Step in progress on this thread, or None


class _QuietInStep(logging.Filter):
    """Drops the library's "'timed out' thrown while requesting ..." line inside a metadata step: the step's own
    one line says what happened (the filter is per thread: other threads' retries still say theirs)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(_metadata, "step", None) is None


_QUIET = _QuietInStep()


@contextlib.contextmanager
def metadata_step(what: str, repo_id: str):
    """Bound every request this thread sends inside the block by :func:`metadata_timeout` seconds to its first
    byte, the library's explicit ``timeout=None`` (its listing's pages) included; a request sent after the bound
    has already passed (the library retrying its timeout) is refused as :class:`MetadataStall`."""
    _metadata.step = _Step(metadata_timeout(), time.monotonic(), what, repo_id)
    library = logging.getLogger("huggingface_hub.utils._http")
    if _QUIET not in library.filters:
        library.addFilter(_QUIET)
    try:
        yield
    finally:
        _metadata.step = None


def _stalled(step: _Step, host: str | None) -> MetadataStall:
    return MetadataStall(f"{step.repo_id}: {step.what}: {host or 'the Hub'} sent no answer within {step.bound:g} s "
                         f"(a metadata request; {METADATA_TIMEOUT_ENV} sets the bound): check the network or "
                         "HF_ENDPOINT")


def _bound_metadata_request(request) -> None:
    """A request hook of the library's client (``bound_library``): within a :func:`metadata_step`, cap the read
    timeout, and stop a retry once the step's bound has passed."""
    step = getattr(_metadata, "step", None)
    if step is None:
        return
    if not step.answered and time.monotonic() - step.started >= step.bound:
        raise _stalled(step, urlparse(str(request.url)).hostname)
    timeout = dict(request.extensions.get("timeout") or {})
    for key in ("read", "connect", "pool"):
        if timeout.get(key) is None or timeout[key] > step.bound:
            timeout[key] = step.bound
    request.extensions["timeout"] = timeout


def _retry_base() -> float:
    return float(os.environ.get("KIMI_CONVERT_RETRY_BASE", "2.0"))


def _retry_budget() -> float:
    """Seconds the Hub may go without a useful answer while a step is retried with backoff: still
    failing after a minute, it is down, not blipping, and re-running later resumes (where anything can)."""
    return float(os.environ.get("KIMI_CONVERT_RETRY_BUDGET", "60"))


_last_answer = 0.0  # time.monotonic() of the Hub's last answer that was not a retriable error


def _saw_answer(response) -> None:
    """A response hook on the library's client: the retry budget counts from the Hub's last useful
    answer, so the library's own retries count, and a long upload that was working is not out of it."""
    global _last_answer
    if (step := getattr(_metadata, "step", None)) is not None:
        step.answered = True
    if response.status_code not in RETRY_STATUS:
        _last_answer = time.monotonic()


# ---------------------------------------------------------------------------------------------
# Before anything heavy: the id's form, a token, the library bounded, one cheap request.


REPO_ID_FORM = ("owner/name: letters, digits, '-', '_' and '.', no '--' or '..', neither starting nor ending "
                "with '-' or '.', at most 96 characters (e.g. my-org/Kimi-K3-NVFP4)")


def check_repo_id(repo_id: str) -> None:
    """The library's own validator, plus an owner: ``create_repo`` would put a bare name under the
    token's user, and every later call would then look for a repo that does not exist."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise ConvertError(f"{repo_id!r} is not a Hub repo id: expected {REPO_ID_FORM}") from None
    if "/" not in repo_id:
        raise ConvertError(f"{repo_id!r} is not a Hub repo id: no owner; expected {REPO_ID_FORM}")


def resolve_token(token: str | None, repo_id: str, *, required: bool) -> str | None:
    """The --token flag, else what the library finds (HF_TOKEN, then the stored ``hf auth login``)."""
    if token:
        return token
    try:
        token = get_token()
    except Exception as e:  # OIDC exchange or OAuth refresh (network) failed: the library says which
        raise ConvertError(f"{repo_id}: getting the token: {_classify(e, contacted=False).text}") from None
    if required and not token:
        raise ConvertError(f"{repo_id}: {NO_TOKEN}")
    return token


_bounded = False


def bound_library() -> None:
    """Give huggingface_hub's HTTP client and Xet finite timeouts and retry budgets (once per process).

    What huggingface_hub 2.4 does by itself, and what is bounded here:

    - Its shared httpx2 client has no timeout at all (``default_client_factory``: ``timeout=None``), so
      a black-holed route holds each request for the kernel's SYN retries (about 2 minutes) and a
      stalled transfer forever. Set through the library's ``set_client_factory``: CONNECT_TIMEOUT s to
      connect, IDLE_TIMEOUT s without a byte. Calls that pass ``timeout=None`` themselves (the tree
      listing's pages) keep no read timeout; the probe has already proved the route by then.
    - ``http_backoff`` (preupload, LFS batch and PUT, the Xet commit, tree pages) retries 408/429/5xx
      and network errors 5 times, sleeping 1+2+4+8+8 s (a 429's Retry-After instead): 23 s of sleep per
      request, plus 6 connect timeouts (60 s) with no route. It takes no setting; left as it is: it is
      the retry of a transfer dropped midway, and it never runs for "no network at start", which the
      probe (a plain request, not retried on a network error) reports first. What the tool adds on
      top (``with_retries``) stops once the Hub has given no useful answer for the retry budget
      (60 s; a response hook on the client keeps the time), the library's retries included, so the
      two do not multiply: a Hub answering 503 to everything ends a step in about 75 s, a route gone
      midway in about 85 s. Only a server that accepts connections and then stalls can hold a request
      longer: 6 idle timeouts.
    - hf_xet retries each transfer for up to 360 s with a 60 s connect timeout: bounded to 60 s and
      CONNECT_TIMEOUT through its own HF_XET_CLIENT_* settings (a value the user set wins); re-running
      ``upload_folder`` resumes what Xet gave up on, deduplicated.
    - HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT bound downloads only: nothing here downloads.
    """
    global _bounded
    if _bounded:
        return
    os.environ.setdefault("HF_XET_CLIENT_CONNECT_TIMEOUT", f"{CONNECT_TIMEOUT:g}s")
    os.environ.setdefault("HF_XET_CLIENT_RETRY_MAX_DURATION", "60s")
    try:
        from huggingface_hub.utils._http import default_client_factory  # the library's own client, to wrap
    except ImportError:  # moved in another version: its client stays unbounded, the probe still fails fast
        _bounded = True
        return

    def bounded_client():
        client = default_client_factory()
        client.timeout = httpx2.Timeout(IDLE_TIMEOUT, connect=CONNECT_TIMEOUT)
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "request": [*hooks.get("request", []), _bound_metadata_request],
                              "response": [*hooks.get("response", []), _saw_answer]}
        return client
    set_client_factory(bounded_client)
    _bounded = True


def connect(repo_id: str, token: str | None, *, write: bool, revision: str | None = None,
            say: Callable[[str], None] = print) -> HfApi:
    """Everything that can fail without reading the output, in the order it costs: the id, the token,
    then one request with a short timeout. For an upload, ``whoami``: the Hub is reachable and the
    token valid and not read-only. For a remote check, ``repo_info``: the repo (and revision) exists
    and is visible. A network error here is not retried: nothing has worked yet, so there is no blip
    to ride out, only a network (or HF_ENDPOINT) to fix."""
    check_repo_id(repo_id)
    token = resolve_token(token, repo_id, required=write)
    bound_library()
    api = HfApi(token=token)
    if write:
        me = with_retries(lambda: _whoami(api), "checking the token", repo_id, say, contacted=False)
        role = ((me.get("auth") or {}).get("accessToken") or {}).get("role")
        if role == "read":
            raise ConvertError(f"{repo_id}: the token of {me.get('name', '?')!r} is read-only: pass one with write "
                               "access (https://huggingface.co/settings/tokens) with --token or HF_TOKEN")
    else:
        with_retries(lambda: api.repo_info(repo_id, revision=revision, timeout=CONNECT_TIMEOUT),
                     "looking up the repository", repo_id, say, contacted=False)
    return api


def _whoami(api: HfApi) -> dict:
    """``whoami`` within CONNECT_TIMEOUT (it takes no timeout): a server that accepts the connection and
    never answers must not hold the probe for IDLE_TIMEOUT."""
    client = get_session()
    saved, client.timeout = client.timeout, httpx2.Timeout(CONNECT_TIMEOUT)
    try:
        return api.whoami()
    finally:
        client.timeout = saved


# ---------------------------------------------------------------------------------------------
# What went wrong, whether retrying or re-running can fix it, said in one line.


@dataclass(frozen=True)
class Failure:
    text: str                  # what went wrong, one line, no token
    retry: bool = False        # another attempt, now, can fix it
    final: bool = True         # re-running the command cannot fix it either (no "resume")
    wait: float | None = None  # the server's Retry-After


def _chain(e: BaseException) -> list[BaseException]:
    """e and what caused it: the library wraps transfer errors (``Error while uploading 'f'``)."""
    out: list[BaseException] = []
    while e is not None and e not in out:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _has_request(e: BaseException) -> bool:
    try:
        return e.request is not None  # httpx raises RuntimeError when the error carries no request
    except RuntimeError:
        return False


def _first(e: BaseException, types) -> BaseException | None:
    return next((x for x in _chain(e) if isinstance(x, types)), None)


def _file(e: BaseException) -> str | None:
    """The file a transfer error is about: only the library's wrapper's message names it."""
    m = next((m for x in _chain(e) if (m := re.search(r"Error while uploading '(.+?)'", str(x)))), None)
    return m[1] if m else None


def _host(e: BaseException) -> str:
    try:
        return e.request.url.host  # type: ignore[attr-defined]  # httpx2.RequestError, once sent
    except (AttributeError, RuntimeError):
        return urlparse(constants.ENDPOINT).netloc or constants.ENDPOINT


def _server_says(e) -> str:
    text = (e.server_message or str(e)).strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def _retry_after(response) -> float | None:
    """Retry-After in seconds, or the ratelimit header's reset when the 429 is about that limit."""
    value = response.headers.get("Retry-After", "").strip()
    if value.isdigit():
        return float(value)
    info = parse_ratelimit_headers(response.headers)
    return float(info.reset_in_seconds) if info is not None and info.remaining == 0 else None


def _http_failure(e) -> Failure:
    status = e.response.status_code
    server = _server_says(e)
    if isinstance(e, GatedRepoError):
        return Failure("gated: request access on the repo's page, with the token's user")
    if isinstance(e, RepositoryNotFoundError):
        return Failure(f"repository not found ({status}), or private and not visible with this token")
    if isinstance(e, RevisionNotFoundError):
        return Failure(f"revision not found ({status})")
    if isinstance(e, DisabledRepoError):
        return Failure(f"the repository is disabled ({status})")
    if status == 401:  # the library's text says which token it used (HF_TOKEN, the stored login)
        return Failure(f"not authenticated (401: {server}): pass a valid token with --token, HF_TOKEN or "
                       "`hf auth login`")
    if status == 403:
        return Failure(f"forbidden (403): the token lacks write access to this repo, or a quota is exceeded "
                       f"({server})")
    if status == 413 or re.search(r"quota|storage", server, re.I):
        return Failure(f"refused by the Hub ({status}): {server}")
    if status == 429:
        return Failure(f"rate limited (429): {server}", retry=True, final=False, wait=_retry_after(e.response))
    if status in RETRY_STATUS:
        return Failure(f"the Hub answered {status}: {server}", retry=True, final=False)
    return Failure(f"refused by the Hub ({status}): {server}")


def _transport_failure(e, contacted: bool) -> Failure:
    host, reason = _host(e), str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, httpx2.UnsupportedProtocol):
        return Failure(f"{host or 'HF_ENDPOINT'}: not an http(s) URL ({reason}): check HF_ENDPOINT")
    if isinstance(e, httpx2.ProxyError):
        return Failure(f"the proxy refused the connection to {host} ({reason}): check HTTPS_PROXY")
    if isinstance(e, httpx2.ConnectError):
        text = f"{host}: cannot connect ({reason}): check the network or HF_ENDPOINT"
    elif isinstance(e, httpx2.TimeoutException):
        text = f"{host}: no answer ({type(e).__name__}): check the network or HF_ENDPOINT"
    else:  # ReadError, WriteError, RemoteProtocolError: a connection that worked, dropped
        text = f"{host}: connection dropped ({reason})"
    # Before the first contact worked, a network error is the network's state, not a blip: say so now.
    return Failure(text, retry=contacted, final=not contacted)


def _classify(e: BaseException, contacted: bool) -> Failure:
    if _first(e, OfflineModeIsEnabled) is not None:
        return Failure("HF_HUB_OFFLINE is set: unset it to reach the Hub")
    if _first(e, LocalTokenNotFoundError) is not None:
        return Failure(NO_TOKEN)
    if (x := _first(e, HFValidationError)) is not None:
        return Failure(str(x).splitlines()[0])
    if (x := _first(e, HfHubHTTPError)) is not None:
        return _http_failure(x)
    if (x := _first(e, httpx2.TransportError)) is not None:
        return _transport_failure(x, contacted)
    root = _chain(e)[-1]
    text = str(root).splitlines()[0][:300] if str(root) else ""
    return Failure(f"{type(root).__name__}: {text}" if text else type(root).__name__, final=False)


def _explain(f: Failure, what: str, repo_id: str, hint: str | None, file: str | None, attempts: int) -> ConvertError:
    where = f"{what} {file}" if file else what
    text = f.text
    if attempts > 1:
        text += f" (after {attempts} attempts)"
    if f.wait is not None and f.wait > MAX_WAIT:
        text += f"; the Hub asks to wait {f.wait:.0f} s"
    return ConvertError(f"{repo_id}: {where}: {text}" + (f"; {hint}" if hint and not f.final else ""))


def _delay(f: Failure, attempt: int, failing_for: float) -> float | None:
    """Seconds before the next attempt, or None: waiting cannot help, or is not worth it in-process.
    The server's Retry-After is honoured up to MAX_WAIT; backoff stops once the Hub has given no
    useful answer for the retry budget (the library's retries inside the step count)."""
    if not f.retry or attempt >= MAX_ATTEMPTS:
        return None
    if f.wait is not None:
        return f.wait if f.wait <= MAX_WAIT else None
    delay = min(_retry_base() * 2 ** (attempt - 1), 60.0)
    return delay if failing_for + delay <= _retry_budget() else None


def with_retries(fn: Callable[[], T], what: str, repo_id: str, say: Callable[[str], None], *,
                 contacted: bool = True, hint: str | None = "try again later") -> T:
    """Run one step; retry it only on what a later attempt can get past: 429 after its Retry-After,
    408 and 5xx with backoff, a dropped connection once the Hub has answered before (``contacted``);
    at most MAX_ATTEMPTS times and, backing off, for the retry budget. Anything else fails at once, as
    one line; ``hint`` (what re-running does) is added only where re-running can help."""
    started = time.monotonic()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        try:
            return fn()
        except MetadataStall:
            raise
        except Exception as e:  # the library's HTTP errors, the transport's, and its own wrappers
            if (stall := _first(e, MetadataStall)) is not None:
                raise MetadataStall(str(stall)) from None
            step = getattr(_metadata, "step", None)
            if step is not None and not step.answered and (t := _first(e, httpx2.ReadTimeout)) is not None:
                raise _stalled(step, urlparse(str(t.request.url)).hostname if _has_request(t) else None) from None
            failing_for = time.monotonic() - max(started, _last_answer)
            f = _classify(e, contacted)
            delay = _delay(f, attempt, failing_for)
            if delay is None:
                raise _explain(f, what, repo_id, hint, _file(e), attempt) from None
            say(f"{repo_id}: {what}: {f.text}; retry {attempt}/{MAX_ATTEMPTS - 1} in {delay:.1f} s")
            time.sleep(delay)
    raise AssertionError("unreachable")
