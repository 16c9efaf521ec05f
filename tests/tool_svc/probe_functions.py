"""Plain functions served as tools, loaded by import path like any user tool."""

import asyncio
import time


def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first addend.
        b: The second addend.
    """
    return a + b


async def repeat(text: str, times: int = 2) -> list[str]:
    """Repeats a text.

    Args:
        text: What to repeat.
        times: How many copies.
    """
    await asyncio.sleep(0)
    return [text] * times


def divide(a: float, b: float) -> str:
    """Divides a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return f"{a / b:g}"


def wait(seconds: float) -> str:
    """Blocks for a while, as a function calling a slow library does.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "done"


def undocumented(a: int) -> int:
    return a
