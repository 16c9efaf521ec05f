"""Reading a final numeric answer out of text, as GSM8K-style tools and interactions do."""

import re
from decimal import Decimal, InvalidOperation

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> Decimal | None:
    """The last number in `text` ('$1,234.50' -> 1234.50), or None."""
    matches = NUMBER.findall(text)
    if not matches:
        return None
    try:
        return Decimal(matches[-1].replace(",", ""))
    except InvalidOperation:
        return None
