"""The project's configuration loader: Kedro's `OmegaConfigLoader` with three additions.

- An environment that does not exist is a user error naming the ones that do (Kedro would load
  `conf/base` alone and fail later on a missing setting).
- `conf/local/` (git-ignored: your machine's overrides and credentials) applies on top of whichever
  environment runs, not only when none is named, so `conf/local/credentials.yml` serves `--env tpu_full`.
- The training session's parameters (`sessions.plan`) apply last, under `--params`.
"""

from __future__ import annotations

from pathlib import Path

from kedro.config import OmegaConfigLoader
from omegaconf import OmegaConf

from tunix_pipeline.config.validation import closest
from tunix_pipeline.core.errors import UserError
from tunix_pipeline.run.sessions import apply_current_session

LOCAL_ENV = "local"


class UnknownEnvironment(UserError, ValueError):
    """`--env` names no folder of `conf/`."""


def environments(conf_source: str | Path) -> list[str]:
    return sorted(p.name for p in Path(conf_source).iterdir() if p.is_dir() and not p.name.startswith("."))


class ProjectConfigLoader(OmegaConfigLoader):
    def __getitem__(self, key: str):
        self._check_environment()
        config = super().__getitem__(key)
        if key in ("parameters", "credentials"):
            config = self._with_local(key, config)
        return apply_current_session(config, self.runtime_params) if key == "parameters" else config

    def _check_environment(self) -> None:
        if self.env is None or not Path(self.conf_source).is_dir() or (Path(self.conf_source) / self.env).is_dir():
            return  # a packaged (zipped, remote) conf_source is left to Kedro
        names = environments(self.conf_source)
        raise UnknownEnvironment(
            f"unknown environment {self.env!r} (--env): {Path(self.conf_source).name}/ has "
            f"{', '.join(names)}{closest(self.env, names)}"
        )

    def _with_local(self, key: str, config: dict) -> dict:
        """`config` with `conf/local`'s files of this kind merged on top, key by key (`--params` still win:
        Kedro merges them into the local parameters too)."""
        run_env = self.env or self.default_run_env
        local_path = Path(self.conf_source) / LOCAL_ENV
        if run_env in (LOCAL_ENV, self.base_env) or not local_path.is_dir():
            return config
        local = self.load_and_merge_dir_config(str(local_path), self.config_patterns[key], key, set(),
                                               read_environment_variables=key == "credentials")
        return OmegaConf.to_container(OmegaConf.merge(config, local), resolve=True) if local else config
