"""Dataset locations in one canonical form, and URLs as they may be shown.

- `canonical(url)`: the one form every dataset URL takes before it is read, written, locked, listed or compared:
  the protocol's aliases folded (s3a://, s3n:// -> s3://; gcs:// -> gs://), scheme and http host lower case, the
  default port dropped, percent-escapes of unreserved characters decoded (%32 -> 2) and the others upper case,
  `.` and `..` segments resolved (RFC 3986), no trailing slash. A local folder (or file:///path) is its resolved
  path: absolute, symlinks and `..` followed (`place`).
- `overlap(a, b)`: whether two canonical places are the same folder, or one lies inside the other; it compares
  without credentials or query, every escape decoded and empty segments dropped, so it errs towards "overlap".
- `redact(url)` / `redact_text(text)`: the one way a URL is recorded or printed. Userinfo (user:password@) is
  dropped, and the value of every query parameter whose name looks like a secret (token, sig, key, password,
  X-Amz-*...) becomes ***. The real URL is only handed to the reads.
"""

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from vlprep import VlprepError, cut

ALIASES = {"s3a": "s3", "s3n": "s3", "gcs": "gs"}
BUCKETS = ("s3", "gs")  # netloc is a bucket: no userinfo, no port, no query (credentials come from the environment)
PORTS = {"http": 80, "https": 443}
UNRESERVED = re.compile(r"%(2[dDeE]|3[0-9]|[46][1-9a-fA-F]|[57][0-9aA]|5[fF]|7[eE])")
ESCAPE = re.compile(r"%[0-9a-fA-F]{2}")
SECRET_NAME = re.compile(r"token|sig|key|secret|pass|pwd|^pw$|auth|bearer|jwt|credential|session|^code$|^x-amz-|"
                         r"^x-goog-", re.IGNORECASE)
USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")
QUERY_PAIR = re.compile(r"([?&;#])([^=&#;?\s]+)=([^&#;\s]*)")
IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
HIDDEN = "***"
ENV_HINT = {"s3": "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or ~/.aws, AWS_PROFILE)",
            "gs": "GOOGLE_APPLICATION_CREDENTIALS (or gcloud auth application-default login)"}


def redact(url: str) -> str:
    """`url` as it may be written or printed: no userinfo, secret-looking query values as ***."""
    if not isinstance(url, str) or "://" not in url:
        return url
    url = USERINFO.sub(r"\1", url)
    return QUERY_PAIR.sub(lambda m: f"{m[1]}{m[2]}={HIDDEN}" if SECRET_NAME.search(unquote(m[2])) else m[0], url)


def redact_text(text: str) -> str:
    """`text` (an error, a log line) with every URL in it redacted."""
    if not isinstance(text, str) or "://" not in text:
        return text

    def one(m) -> str:  # the punctuation after a URL ("URL: why") is the sentence's, not the URL's
        url = m[0].rstrip(":,.;)]")
        return redact(url) + m[0][len(url):]

    return IN_TEXT.sub(one, text)


def scheme(url: str) -> str:
    """A URL's scheme, lower case, its alias folded (s3a -> s3); '' for a local path."""
    kind = url.split("://", 1)[0].lower() if "://" in url else ""
    return ALIASES.get(kind, kind)


def _path(path: str) -> str:
    """A URL path normalised: unreserved escapes decoded, others upper case, dot segments resolved, no trailing /."""
    path = UNRESERVED.sub(lambda m: chr(int(m[1], 16)), path)
    path = ESCAPE.sub(lambda m: m[0].upper(), path)
    out: list[str] = []
    for seg in path.split("/"):
        if seg == "..":
            if len(out) > 1:
                out.pop()
        elif seg != ".":
            out.append(seg)
    return "/".join(out).rstrip("/")


def canonical(url: str) -> str:
    """A dataset URL in its one canonical form (module docstring); a VlprepError (redacted) for credentials or a
    query string on s3:// or gs://, which take theirs from the environment."""
    kind = scheme(url)
    parts = urlsplit(url, allow_fragments=kind not in BUCKETS)
    netloc = parts.netloc
    path = _path(parts.path)
    query = parts.query
    if kind in BUCKETS:
        if "@" in netloc:
            raise VlprepError(f"{cut(redact(url))}: credentials in the URL are not read ({kind}:// takes them from "
                              f"the environment; the URL would be recorded with them): remove them and set "
                              f"{ENV_HINT[kind]}")
        if query:
            raise VlprepError(f"{cut(redact(url))}: a query string on a {kind}:// dataset URL is not supported; name "
                              "the folder only (credentials come from the environment)")
    elif kind in PORTS:
        user, at, host = netloc.rpartition("@")
        host = host.lower()
        if host.endswith(f":{PORTS[kind]}"):
            host = host[: -len(str(PORTS[kind])) - 1]
        netloc = f"{user}{at}{host}"
    return urlunsplit((kind, netloc, path, query, ""))


def join(url: str, name: str) -> str:
    """File `name` inside the canonical folder `url`: before its query string (`.../ds/sizes.json?token=T`)."""
    kind = scheme(url)
    parts = urlsplit(url, allow_fragments=kind not in BUCKETS)
    return urlunsplit((parts.scheme, parts.netloc, f"{parts.path.rstrip('/')}/{name}", parts.query, ""))


def file_url_path(url: str) -> str:
    """file:///data/ds -> /data/ds (file://host/... is refused: it names another machine)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise VlprepError(f"{cut(redact(url))}: a file:// URL names a local path (file:///path); use the path "
                          "itself")
    return unquote(parts.path)


def place(where) -> str | Path:
    """A dataset location as compared: a URL's canonical form, or a local folder's resolved Path (file:// too)."""
    if isinstance(where, str) and "://" in where:
        if scheme(where) != "file":
            return canonical(where)
        where = file_url_path(where)
    return Path(where).expanduser().resolve()


def _key(url: str) -> tuple:
    """What two canonical URLs are compared on: no credentials or query, every escape decoded, bucket lower case."""
    parts = urlsplit(url, allow_fragments=scheme(url) not in BUCKETS)
    host = parts.netloc.rpartition("@")[2].lower()
    return (scheme(url), host, *[s for s in unquote(parts.path).split("/") if s])


def overlap(a, b) -> str | None:
    """'same', 'inside' (a lies inside b), 'contains' (a holds b) or None, for two dataset locations."""
    a = place(a)
    b = place(b)
    if isinstance(a, Path) != isinstance(b, Path):
        return None
    ka, kb = (a.parts, b.parts) if isinstance(a, Path) else (_key(a), _key(b))
    if ka == kb:
        return "same"
    if ka[: len(kb)] == kb:
        return "inside"
    if kb[: len(ka)] == ka:
        return "contains"
    return None
