"""The dtypes hidden states can be stored in, named once: the settings validate against these names,
the sample format (`sample_file.py`) maps them to torch dtypes. No torch here, so settings stay light."""

from __future__ import annotations

from typing import Literal, get_args

StorageDtype = Literal["bfloat16", "float16", "float32", "float8_e4m3fn"]
STORAGE_DTYPE_NAMES: tuple[str, ...] = get_args(StorageDtype)
