"""Both tar codecs of our shards: `ShardTarWriter` writes them, `TarReader` reads them fast.

Both are hand-written where the project prefers libraries, and both are held byte- or member-identical to the library
they stand in for (webdataset's TarWriter; tarfile) by reference tests kept together in one test file.

The writer. `webdataset.TarWriter` -> `tarfile.addfile` rebuilds all 17 header fields and sums 512 bytes per member,
which was most of the work of `vlprep shards` (pass-through) and `vlprep bow`. In our members only the name, the size
and the checksum vary, so the header is a template built once by tarfile itself with those three fields patched in.

The reader yields the regular-file members of a shard as (name, offset_data, size), parsing their 512-byte headers
directly; `tarfile` takes over wherever a header is anything else. `tarfile` decodes all 17 fields, runs nti() on each
number and sums the 512 bytes twice, in Python, for the checksums: that was half of `vlprep bow`'s time. The shards
vlprep writes and webdataset's TarWriter write plain ustar headers, which need only the name, prefix, size, type and
checksum read, and the other numbers checked once.

The rule that keeps the reader safe: the fast path reads a header only when it is sure that `tarfile.open(path, "r:")`
reads the same member at the same offset. That means: the checksum matches as an unsigned sum; the checksum and the
size are plain octal, and the other numbers are ones tarfile's nti() reads; the type is a regular file, directory,
link, device or FIFO; a file's data ends inside the file. Anything else hands the whole tar to tarfile, which reads
from the start and skips the members already yielded: a pax (`x`, `g`) or GNU (`L`, `K`, `S`) extended header, an
unknown type, a signed checksum, a header that does not check out, a member or header cut short, an empty file.
So the members, the errors (tarfile.ReadError) and the shortened member list that tarfile gives on a damaged tar
(it takes a corrupt header for the end of the archive) are tarfile's own.
"""

import json
import os
import tarfile
import zlib
from collections.abc import Iterator

# Fixed tar metadata so a shard's bytes depend only on its samples (re-runs and resumes are identical).
TAR_MTIME = 0


# --- the writer -------------------------------------------------------------------------------------------------------


# json.dumps(v, ensure_ascii=False, sort_keys=True) builds a new JSONEncoder per call (about half of its cost on
# our 4-key metadata); one encoder with the same options writes the same text. allow_nan=False: a NaN or an infinity
# would be written as `NaN` / `Infinity`, which is no JSON (strict parsers refuse the sample): a ValueError instead.
_json_encode = json.JSONEncoder(ensure_ascii=False, sort_keys=True, allow_nan=False).encode


def _payload(v):
    """A member's payload as written: str as UTF-8, dict as our JSON; anything else as it is."""
    if isinstance(v, str):
        return v.encode("utf-8")
    if isinstance(v, dict):
        return _json_encode(v).encode("utf-8")
    return v


def encode_sample(sample: dict) -> dict:
    """Sample dict with str/dict payloads -> bytes payloads in a fixed member order."""
    out = {"__key__": sample["__key__"]}
    for k in sorted(sample):
        if not k.startswith("__"):
            out[k] = _payload(sample[k])
    return out


class ShardTarWriter:
    """Plain USTAR tar writer for our shards, byte for byte what `webdataset.TarWriter(f, encoder=False,
    mtime=TAR_MTIME, user="", group="", mode=0o644)` writes with its tarfile stream set to USTAR_FORMAT.

    The project prefers webdataset's TarWriter, and this class was that until it was measured (module docstring):
    most of TarWriter's time per member is TarInfo.tobuf rebuilding all 17 header fields and summing 512 bytes, plus
    copy.copy(tarinfo) and a copy through BytesIO. Anything outside the fast path (a name over 100 bytes, which ustar
    splits into prefix + name or refuses; a size of 8 GiB or more) goes through TarInfo.tobuf, so it gets exactly
    tarfile's header or tarfile's error.
    """

    def __init__(self, f):
        self.f = f
        self.offset = 0

    def _slow_header(self, name: str, size: int) -> bytes:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uname, ti.gname = size, TAR_MTIME, 0o644, "", ""
        return ti.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape")

    def header(self, name: str, size: int) -> bytes:
        raw = name.encode(tarfile.ENCODING, "surrogateescape")
        if len(raw) > 100 or size >= _SIZE_LIMIT:
            return self._slow_header(name, size)
        size_field = b"%011o\0" % size
        chksum = _HDR_SUM + sum(raw) + sum(size_field)
        return b"".join((raw, bytes(100 - len(raw)), _HDR_MODE_IDS, size_field, _HDR_MTIME,
                         b"%06o\0 " % chksum, _HDR_TAIL))

    def add(self, name: str, data: bytes) -> None:
        """One member `name` holding `data` (tarfile.addfile with our fixed metadata)."""
        size = len(data)
        self.f.write(self.header(name, size))
        self.f.write(data)
        pad = -size % 512
        if pad:
            self.f.write(bytes(pad))
        self.offset += 512 + size + pad

    def write(self, sample: dict) -> None:
        """One encoded sample (see encode_sample), with TarWriter.write's checks and member order."""
        if "__key__" not in sample:
            raise ValueError("object must contain a __key__")
        members = [(k, v) for k, v in sorted(sample.items()) if k[0] != "_"]
        for k, v in members:
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"{k} doesn't map to a bytes after encoding ({type(v)})")
        key = sample["__key__"] + "."
        for k, v in members:
            self.add(key + k, v)

    def write_sample(self, sample: dict) -> None:
        """write(encode_sample(sample)) in one pass over the sample (write_shard calls it for every sample)."""
        key = sample["__key__"] + "."
        members = []
        for k in sorted(sample):
            if k[0] == "_":  # encode_sample drops "__*", write "_*"
                continue
            v = _payload(sample[k])
            if not isinstance(v, (bytes, bytearray, memoryview)):
                raise ValueError(f"{k} doesn't map to a bytes after encoding ({type(v)})")
            members.append((k, v))
        for k, v in members:
            self.add(key + k, v)

    def close(self) -> None:
        """The end of the archive as tarfile writes it: two zero blocks, then zeros up to a 10240-byte record."""
        end = 1024 + (-(self.offset + 1024) % tarfile.RECORDSIZE)
        self.f.write(bytes(end))
        self.offset += end

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header_template() -> tuple[bytes, bytes, bytes, int]:
    """The fixed parts of our member headers, built by tarfile: (mode/uid/gid, mtime, tail, checksum of them)."""
    ti = tarfile.TarInfo("")
    ti.mtime = TAR_MTIME
    ti.mode = 0o644
    ti.uname = ""
    ti.gname = ""
    buf = ti.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape")
    mode_ids = buf[100:124]
    mtime = buf[136:148]
    tail = buf[156:512]
    # the checksum is the byte sum of the header with its own 8-byte field read as spaces
    return mode_ids, mtime, tail, sum(mode_ids) + sum(mtime) + 8 * ord(" ") + sum(tail)


_HDR_MODE_IDS, _HDR_MTIME, _HDR_TAIL, _HDR_SUM = _header_template()
_SIZE_LIMIT = 8**11  # ustar's 11 octal digits


# --- the reader -------------------------------------------------------------------------------------------------------

BLOCK = tarfile.BLOCKSIZE
_ZERO = bytes(BLOCK)
_FILE = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)  # tarfile's REGULAR_TYPES but GNU sparse
# Member types with no data blocks after the header (tarfile skips none for them, whatever their size field says).
_NO_DATA = (tarfile.DIRTYPE, tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE)
# mode, uid, gid, mtime, devmajor, devminor: tarfile parses them (a bad one ends the archive) and we do not use them
_OTHER_NUMBERS = ((100, 108), (108, 116), (116, 124), (136, 148), (329, 337), (337, 345))


def _octal(field: bytes) -> int:
    """A header number as tarfile's nti() reads it, when it is plain octal; ValueError otherwise (a base-256 number,
    non-ASCII bytes, a character str.strip() would strip but bytes.strip() does not): then tarfile decides."""
    return int(field.split(b"\0", 1)[0].strip() or b"0", 8)


def _unsigned_checksum(hdr: bytes) -> int:
    """256 + the byte sum of the header without its checksum field, as tarfile's calc_chksums()[0] computes it.

    The byte sum of 256 bytes is at most 65,280, under Adler-32's modulus 65,521, so the low half of adler32() of
    each half header is exactly 1 + its byte sum: two calls in C instead of a 512-step sum in Python.
    """
    adler = zlib.adler32
    return 256 + (adler(hdr[:256]) & 0xFFFF) + (adler(hdr[256:]) & 0xFFFF) - 2 - sum(hdr[148:156])


class TarReader:
    """The regular-file members of one tar: iterate for (name, offset_data, size), in archive order, as
    `[(m.name, m.offset_data, m.size) for m in tarfile.open(path, "r:") if m.isfile()]`; `read` for their bytes.

    Iterating raises tarfile.ReadError where tarfile would (an empty file, a first header that is not one, a member
    cut short). Use it as a context manager (it owns the open file). A URL (s3://, gs://, http(s)://) is read in
    ranged blocks through vlprep.objstore, whose reads resume after a transient fault (`on_retry` counts them).
    """

    def __init__(self, path: str | os.PathLike, buffering: int = 1 << 16, on_retry=None):
        # 64 KiB: as fast as 1 MiB on shards of small members read whole, and a header-only scan of large members
        # reads little more than tarfile's 8 KiB per header
        from vlprep import objstore

        if objstore.is_remote(path):
            self.f = objstore.open_read(path, on_retry, buffering)
            self.size = self.f.raw.size
        else:
            self.f = open(path, "rb", buffering=buffering)
            self.size = None
        self._tf: tarfile.TarFile | None = None
        self._sparse: dict[int, tarfile.TarInfo] = {}
        self.fast = True  # False once tarfile has taken over (tests read it)

    def __enter__(self) -> "TarReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._tf is not None:
            self._tf.close()  # (it leaves our file open: it was given a file object)
        self.f.close()

    def read(self, offset: int, size: int) -> bytes:
        """The `size` bytes at `offset` (a member's data); tarfile's ReadError when the file ends before them."""
        if self._sparse and offset in self._sparse:  # a GNU sparse member (tarfile only): its holes filled in
            return self._tf.extractfile(self._sparse[offset]).read()
        f = self.f
        f.seek(offset)
        data = f.read(size)
        if len(data) != size:
            raise tarfile.ReadError("unexpected end of data")  # what tarfile's extractfile().read() raises
        return data

    def __iter__(self) -> Iterator[tuple[str, int, int]]:
        f = self.f
        enc = tarfile.ENCODING
        file_size = os.fstat(f.fileno()).st_size if self.size is None else self.size
        checked = set()  # the other numbers' bytes of headers already found readable (one value in our shards)
        pos = 0
        while True:
            f.seek(pos)
            hdr = f.read(BLOCK)
            if len(hdr) != BLOCK:
                if not hdr and pos:  # the file ends at a header boundary: tarfile's end of the archive
                    return
                break  # an empty file, or a header cut short
            if hdr == _ZERO:  # tarfile's end of the archive (without ignore_zeros)
                return
            try:
                if _octal(hdr[148:156]) != _unsigned_checksum(hdr):
                    break
                size = _octal(hdr[124:136])
                others = hdr[100:124] + hdr[136:148] + hdr[329:345]
                if others not in checked:
                    for a, b in _OTHER_NUMBERS:
                        tarfile.nti(hdr[a:b])  # InvalidHeaderError where tarfile would stop
                    if len(checked) < 64:
                        checked.add(others)
            except (ValueError, tarfile.HeaderError):
                break
            kind = hdr[156:157]
            name = hdr[:100]
            cut = name.find(b"\0")
            if cut >= 0:
                name = name[:cut]
            if kind in _NO_DATA or (kind == tarfile.AREGTYPE and name.endswith(b"/")):  # (a v7 directory)
                pos += BLOCK
                continue
            if kind not in _FILE or size < 0:
                break
            end = pos + BLOCK + size + (-size % BLOCK)
            if end > file_size:
                break  # cut short: tarfile raises "unexpected end of data" when it gets here
            name = name.decode(enc, "surrogateescape")
            prefix = hdr[345:500]
            if prefix[0]:  # ustar's long names: prefix + "/" + name, each field decoded alone as tarfile does
                cut = prefix.find(b"\0")
                name = (prefix if cut < 0 else prefix[:cut]).decode(enc, "surrogateescape") + "/" + name
            yield name, pos + BLOCK, size
            pos = end
        yield from self._with_tarfile(pos)

    def _with_tarfile(self, start: int) -> Iterator[tuple[str, int, int]]:
        """tarfile's members from the header at `start` on (those before it have been yielded)."""
        self.fast = False
        self.f.seek(0)
        self._tf = tarfile.open(fileobj=self.f, mode="r:")
        for info in self._tf:
            if info.offset < start or not info.isfile():
                continue
            if info.sparse is not None:
                self._sparse[info.offset_data] = info
            yield info.name, info.offset_data, info.size
