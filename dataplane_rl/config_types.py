"""A base for config models: no silent bool/int casts, no NaN or infinity.

Pydantic's lax mode turns `true` into 1 for a count and `1` into True for a flag; full strict mode would
also refuse `1e-5` (YAML 1.1 reads it as a string). So only those two casts are refused here.
"""

from __future__ import annotations

import typing

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

CONFIG = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class StrictScalars(BaseModel):
    model_config = CONFIG

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_int_casts(cls, value, info: ValidationInfo):
        ann = cls.model_fields[info.field_name].annotation
        kinds = set(typing.get_args(ann)) | {ann}
        if int in kinds and bool not in kinds and isinstance(value, bool):
            raise ValueError("must be an integer, not true/false")
        if ann is bool and not isinstance(value, bool):
            raise ValueError("must be true or false")
        return value
