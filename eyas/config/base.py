"""What every config section shares: the strict base model, the error a bad config raises, and the
value types that reach a shell where quoting cannot help."""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from eyas.errors import EyasError
from eyas.secrets import check_address, check_env_name


class ConfigError(EyasError, ValueError):
    """A config file that cannot be used; the message names the file, the field and the value."""


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


#: Values that reach a shell where quoting cannot help: validated (eyas/secrets.py,
#: docs/operations.md "Secrets").
EnvName = Annotated[str, AfterValidator(check_env_name)]  #: [A-Za-z_][A-Za-z0-9_]*
Address = Annotated[str, AfterValidator(check_address)]  #: an IP address or a host name
