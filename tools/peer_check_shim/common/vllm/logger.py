"""Shim of vllm.logger: standard logging with vLLM's *_once helpers."""
import logging

_seen = set()


class _Logger(logging.LoggerAdapter):
    def _once(self, level, msg, *args):
        key = (level, msg, args)
        if key not in _seen:
            _seen.add(key)
            self.log(level, msg, *args)

    def warning_once(self, msg, *args, **kwargs):
        self._once(logging.WARNING, msg, *args)

    def info_once(self, msg, *args, **kwargs):
        self._once(logging.INFO, msg, *args)

    def debug_once(self, msg, *args, **kwargs):
        self._once(logging.DEBUG, msg, *args)


def init_logger(name: str):
    return _Logger(logging.getLogger(name), {})
