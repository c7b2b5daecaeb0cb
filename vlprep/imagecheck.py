"""Image checks without decoding, for `vlprep shards`' pass-through: the end-of-image checks, and `probe`, which reads
a PNG's or JPEG's format and size from its header the way Pillow's `Image.open` does, at a fraction of the cost.

Why not just `Image.open`: on a pass-through run it was the largest single cost of vlprep's own work per image,
because Pillow parses every chunk or marker before the image data in Python, through a file object, building info dicts nobody reads here. `probe` walks the same bytes directly.

The rule that keeps it safe: `probe` answers only when it is sure `Image.open` would have succeeded with the same
(format, width, height) and the end check passes; anything unusual (a chunk or marker whose Pillow handler can
reject the file, a second header, a size Pillow would warn about, a CRC mismatch, a WebP) returns None, and the
caller takes the Pillow path, so every skip reason and every accepted image stay exactly what they were (the two
paths are tested against each other on valid, damaged and unusual files).

The PNG end check is structural by default: every chunk length is walked to IEND and every chunk's CRC is checked
except IDAT's, whose payload is skipped. IDAT is nearly all of a PNG's bytes, and its CRC was a tenth of vlprep's
own time on a pass-through run; a file cut short still fails (a length runs past the end, or IEND is missing),
and so does a damaged header chunk (Pillow reads those at open). A flipped byte inside IDAT data is left to the
decoder: `--decode-check` (`idat_crc=True`) checks every CRC and decodes, and training skips and counts a sample
that does not decode. docs/FORMAT.md, "What the readers refuse", has the contract.
"""

import re
import struct
import zlib

from PIL import Image, PngImagePlugin

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
_CID = re.compile(rb"\w\w\w\w")  # Pillow's is_cid: a chunk type it will read at all
_CHUNK = struct.Struct(">I4s")  # a chunk's length and type; its CRC
_CRC = struct.Struct(">I")
# Pillow's PNG chunk handlers that never reject a file, and those that check a minimum length (in bytes; tRNS
# depends on the mode and is checked apart). Any other chunk with a handler (iCCP, zTXt, iTXt, acTL, fcTL, fdAT)
# sends the image down Pillow's path; chunks without a handler are skipped by Pillow, and here.
_PNG_SAFE = {b"PLTE": 0, b"eXIf": 0, b"tEXt": 0, b"gAMA": 4, b"cHRM": 32, b"sRGB": 1, b"pHYs": 9}
_PNG_HANDLED = {name[len("chunk_"):].encode() for name in dir(PngImagePlugin.PngStream) if name.startswith("chunk_")}
_TRNS_MIN = {"1": 2, "L": 2, "I;16": 2, "RGB": 6}
# JPEG markers before the scan whose Pillow handler only stores or skips bytes (DHT, DRI, COM, APP0 = JFIF); DQT
# and SOF0-2 are checked as Pillow checks them. APP1-15 (EXIF, ICC, MPF for MPO, Adobe) go down Pillow's path.
_JPEG_SKIP = {0xC4, 0xDD, 0xFE, 0xE0}
_JPEG_SOF = {0xC0, 0xC1, 0xC2}
_JPEG_LAYERS = (1, 3, 4)


def png_chunks_ok(data: bytes, idat_crc: bool = False) -> bool:
    """Every PNG chunk's length lines up, ending at IEND, and every chunk's CRC matches, IDAT's only with `idat_crc`:
    a cut file with its IEND kept fails either way; a flipped byte inside IDAT data fails only with `idat_crc`."""
    return _png_walk(data, idat_crc) is not None


def _png_walk(data: bytes, idat_crc: bool = False) -> tuple[int, int, bool] | None:
    """(width, height, Pillow would open it as we read it) of a PNG whose chunks all check out, else None.

    IDAT's CRC is checked only with `idat_crc` (the module docstring says why)."""
    view = memoryview(data)
    n = len(data)
    crc32 = zlib.crc32
    unpack = _CHUNK.unpack_from
    stored = _CRC.unpack_from
    pos = 8
    size = None
    simple = True
    mode = ""
    text = 0
    # The chunks Pillow reads at open (up to the first IDAT): checked as its handlers check them.
    while pos + 12 <= n:
        length, cid = unpack(data, pos)
        end = pos + 12 + length
        if end > n or ((cid != b"IDAT" or idat_crc)
                       and crc32(view[pos + 4:end - 4]) != stored(data, end - 4)[0]):
            return None
        pos = end
        if cid == b"IDAT":
            break
        if cid == b"IEND":
            return (size[0], size[1], False) if size else (0, 0, False)
        if not simple:
            continue
        if cid == b"IHDR":
            hdr = data[end - 4 - length:end - 4]
            if size is not None or length < 13 or hdr[11]:  # a second IHDR; too short; unknown filter method
                simple = False
            else:
                size = (int.from_bytes(hdr[0:4], "big"), int.from_bytes(hdr[4:8], "big"))
                mode = PngImagePlugin._MODES.get((hdr[8], hdr[9]), ("",))[0]
                simple = mode != ""  # Pillow refuses a bit depth / colour type pair it has no mode for
        elif size is None:  # Pillow reads chunks before IHDR, but we only vouch for IHDR first
            simple = False
        elif cid == b"tRNS":
            simple = length >= _TRNS_MIN.get(mode, 0)
        elif cid in _PNG_SAFE:
            simple = length >= _PNG_SAFE[cid]
            if cid == b"tEXt":
                text += length
                simple = text <= PngImagePlugin.MAX_TEXT_MEMORY
        elif cid in _PNG_HANDLED or not _CID.fullmatch(cid):
            simple = False
    else:
        return None
    # The rest: lengths and CRCs only (IDAT's with idat_crc), up to IEND.
    while pos + 12 <= n:
        length, cid = unpack(data, pos)
        end = pos + 12 + length
        if end > n or ((cid != b"IDAT" or idat_crc)
                       and crc32(view[pos + 4:end - 4]) != stored(data, end - 4)[0]):
            return None
        if cid == b"IEND":
            return (size[0], size[1], simple) if size else (0, 0, False)
        pos = end
    return None


def _jpeg_head(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the markers before the first scan, when each is one Pillow handles without a doubt."""
    pos = 2
    n = len(data)
    size = None
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None  # Pillow skips junk between markers; we do not vouch for it
        marker = data[pos + 1]
        length = (data[pos + 2] << 8) | data[pos + 3]
        body = data[pos + 4:pos + 2 + length]
        if length < 2 or len(body) != length - 2:
            return None
        if marker == 0xDA:  # start of scan: the header is complete
            return size
        if marker in _JPEG_SOF:
            if size is not None or len(body) < 6 or body[0] != 8 or body[5] not in _JPEG_LAYERS:
                return None
            size = ((body[3] << 8) | body[4], (body[1] << 8) | body[2])
        elif marker == 0xDB:
            while body:  # Pillow's DQT: each table must be whole
                need = 1 + (1 if body[0] < 16 else 2) * 64
                if len(body) < need:
                    return None
                body = body[need:]
        elif marker not in _JPEG_SKIP or (marker == 0xE0 and body.startswith(b"JFIF") and len(body) < 12):
            return None
        pos += 2 + length
    return None


def probe(data: bytes) -> tuple[str, int, int] | None:
    """(Pillow format, width, height) of a PNG or JPEG that `Image.open` opens just so and whose end check passes;
    None means: ask Pillow (see the module docstring)."""
    if data.startswith(PNG_MAGIC):
        walked = _png_walk(data)
        if walked is None or not walked[2]:
            return None
        fmt, (w, h) = "PNG", walked[:2]
    elif data.startswith(b"\xff\xd8\xff"):
        head = _jpeg_head(data)
        if head is None or data.rstrip(b"\0")[-2:] != b"\xff\xd9":
            return None
        fmt, (w, h) = "JPEG", head
    else:
        return None
    limit = Image.MAX_IMAGE_PIXELS
    if w <= 0 or h <= 0 or (limit is not None and w * h > limit):
        return None  # Pillow refuses a zero size and warns about, or refuses, a huge one: let it
    return fmt, w, h


def looks_complete(data: bytes, fmt: str, idat_crc: bool = False) -> bool:
    """End-of-image check without decoding: catches files cut short in a download or copy (PNG: every chunk's length,
    and its CRC but IDAT's unless `idat_crc`, which --decode-check passes)."""
    if fmt in ("JPEG", "MPO"):
        return data.rstrip(b"\0")[-2:] == b"\xff\xd9"
    if fmt == "PNG":
        return png_chunks_ok(data, idat_crc)
    if fmt == "WEBP":
        return len(data) >= 12 and int.from_bytes(data[4:8], "little") + 8 <= len(data)
    return True

