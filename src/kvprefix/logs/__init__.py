"""The request-log record (one versioned schema), its writer, and the one reader of body logs and request logs
that the planner and the doctor share (no torch)."""

from kvprefix.logs.adapters import AdapterNames, adapter_extras
from kvprefix.logs.entries import LogEntry, SharedTools, iter_bodies, iter_entries, iter_request_log
from kvprefix.logs.request_log import FORMAT_VERSION, RequestLogWriter, RequestRecord, iter_records
from kvprefix.logs.rows import BODIES, MOONCAKE, REQUEST_LOG, LogError, detect_format, iter_rows

__all__ = ["BODIES", "AdapterNames", "adapter_extras", "FORMAT_VERSION", "MOONCAKE", "REQUEST_LOG", "LogEntry", "LogError", "RequestLogWriter",
           "RequestRecord", "SharedTools", "detect_format", "iter_bodies", "iter_entries", "iter_records",
           "iter_request_log", "iter_rows"]
