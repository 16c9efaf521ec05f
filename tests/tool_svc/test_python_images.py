"""The `python` tool returns the images its code saves under /workspace (real sandbox)."""

import io

import PIL.Image

from tests.tool_svc.test_python_sandbox import python_tool, run

# Sandboxed code has the standard library only: it writes PNGs with zlib.
WRITE_PNG = """
import os, struct, zlib

def png(width, height, rgb):
    rows = b"".join(b"\\x00" + bytes(rgb) * width for _ in range(height))
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\\x89PNG\\r\\n\\x1a\\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")

def save(path, width, height, rgb):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "wb") as f:
        f.write(png(width, height, rgb))
"""


def pixels(image) -> tuple[tuple[int, int], tuple[int, ...]]:
    with PIL.Image.open(io.BytesIO(image.data)) as decoded:
        return decoded.size, decoded.convert("RGB").getpixel((0, 0))


async def test_images_a_call_saves_come_back_in_path_order():
    code = WRITE_PNG + (
        "save('plot.png', 3, 2, (255, 0, 0))\n"
        "save('out/chart.PNG', 2, 2, (0, 0, 255))\n"
        "open('notes.txt', 'w').write('not an image')\n"
        "print('saved')"
    )
    async with python_tool() as tool:
        result = await run(tool, code)
    assert result.text == "saved\n"
    assert [image.mime_type for image in result.images] == ["image/png", "image/png"]
    assert [pixels(image) for image in result.images] == [
        ((2, 2), (0, 0, 255)),  # out/chart.PNG sorts before plot.png
        ((3, 2), (255, 0, 0)),
    ]


async def test_what_cannot_be_shown_is_named_and_links_are_not_followed():
    code = WRITE_PNG + (
        "import os\n"
        "for name in 'abcd':\n"
        "    save(f'{name}.png', 2, 2, (9, 9, 9))\n"
        "open('big.png', 'wb').write(b'\\x89PNG' + bytes(1000))\n"
        "open('broken.png', 'wb').write(b'\\x89PNG not really')\n"
        "os.symlink('/etc/passwd', 'passwd.png')\n"
        "os.symlink('/etc', 'etc_dir')\n"
    )
    async with python_tool(max_images=3, max_image_bytes=300) as tool:
        result = await run(tool, code)
    # a, b and c; big.png, broken.png and d.png are named instead; the links are not read.
    assert [pixels(image) for image in result.images] == [((2, 2), (9, 9, 9))] * 3
    lines = result.text.splitlines()
    assert "[big.png not shown: 1004 bytes, over 300]" in lines
    assert (
        "[not shown: broken.png: not a readable image (no image format recognised in its bytes)]"
        in lines
    )
    assert "[d.png not shown: at most 3 images per call]" in lines
    assert len(lines) == 3
    assert "passwd" not in result.text and "etc" not in result.text


async def test_a_session_shows_the_images_each_call_writes_or_changes():
    code = WRITE_PNG
    async with python_tool(enable_stateful_sessions=True) as tool:
        session = await tool.create()
        try:
            first = await run(tool, code + "save('a.png', 2, 2, (1, 1, 1))", session)
            second = await run(tool, "save('b.png', 2, 2, (2, 2, 2))", session)
            unchanged = await run(tool, "1 + 1", session)
            rewritten = await run(tool, "save('a.png', 4, 4, (3, 3, 3))", session)
        finally:
            await tool.release(session)
    assert [pixels(image) for image in first.images] == [((2, 2), (1, 1, 1))]
    assert [pixels(image) for image in second.images] == [((2, 2), (2, 2, 2))]
    assert unchanged.images == [] and unchanged.text == "2\n"
    assert [pixels(image) for image in rewritten.images] == [((4, 4), (3, 3, 3))]


async def test_max_images_zero_returns_none():
    async with python_tool(max_images=0) as tool:
        result = await run(tool, WRITE_PNG + "save('a.png', 2, 2, (1, 1, 1))")
    assert result.images == [] and result.text == "(no output)"
