"""The tools' file reads and writes: atomic writes (a temp file beside the target, synced, renamed), JSON and
JSON Lines out, and inputs read so that a stop signal still ends a wait on a FIFO, JSON objects refused with
the file named when malformed or holding text no encoding can write."""
import json
import os
import select
import stat

from Utils.jittor_env import StopFlag, Stopped

# Temp files of interrupted writes start with this, beside the file they were to replace
# (.tmp<pid>.<name>: the writer's pid; Utils/output_dirs.remove_stale_temp removes those of dead writers).
TMP_PREFIX = ".tmp"


def temp_name(name):
    """The name this process gives the temp file or folder that becomes `name`."""
    return f"{TMP_PREFIX}{os.getpid()}.{name}"


def atomic_write(path, write):
    """Write `path` through `write(tmp_path)` into a temp file beside it, synced, then renamed over
    `path`: a reader, a crash or a kill -9 never leaves half a file under the real name."""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp_path = os.path.join(folder, temp_name(name))
    try:
        write(tmp_path)
        fd = os.open(tmp_path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp_path, path)
    except OSError as e:  # name the file meant, not its temp (e.g. ENOSPC while writing)
        raise OSError(e.errno, e.strerror or str(e), path) from None
    finally:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
    return path


def write_json(obj, path):
    """Atomically write `obj` as indented JSON."""
    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
    return atomic_write(path, write)


def write_jsonl(rows, path):
    """Atomically write `rows` as JSON lines, one object a line."""
    def write(tmp):
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return atomic_write(path, write)


POLL_SECONDS = 0.2  # how long a read of a FIFO or device waits before it looks for a stop signal


def read_input(path) -> bytes:
    """The bytes of an input file. A regular file is read at once; anything else (a FIFO, a device) is read
    by polling, so a writer that never comes still lets a stop signal end the process (Stopped)."""
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"{path} is a folder, not a file")
    if stat.S_ISREG(mode):
        with open(path, "rb") as f:
            return f.read()
    stop, chunks = StopFlag(), []
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO's open would block until a writer comes
    try:
        while not stop.poll():
            if not select.select([fd], [], [], POLL_SECONDS)[0]:
                continue
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
        raise Stopped(stop.name)
    finally:
        os.close(fd)


def read_json_object(path, what: str) -> dict:
    """A JSON file holding one object; malformed JSON, another value or text that cannot be encoded
    (check_encodable) is a ValueError naming the file."""
    try:
        value = json.loads(read_input(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object of {what}")
    check_encodable(value, path)
    return value


def check_encodable(value, path, what: str = ""):
    """Refuse JSON text holding a string that no encoding can write: a lone surrogate, which an escape
    such as \\ud800 makes and json reads without complaint, but a tokenizer, a prediction file or the
    terminal then fails on. Every JSON input of the tools passes here as it is read (objects, data sets,
    each line of a JSON Lines file); the error names the file, `what` (an example, a line) and the field."""
    found = unencodable(value)
    if found is not None:
        where, char = found
        place = " ".join(part for part in (what, f"field '{where}'" if where else "") if part)
        raise ValueError(f"{path}: {place + ' ' if place else ''}holds a lone surrogate ({ascii(char)}), text that "
                         "no encoding can write: fix or drop it")


def unencodable(value, where: str = ""):
    """(where, the character) of the first string in `value` (lists and objects, keys too) that UTF-8
    cannot encode; None when there is none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return None
        except UnicodeEncodeError as e:
            return where, value[e.start]
    if isinstance(value, dict):
        items = [(key, f"{where}.{key}" if where else str(key)) for key in value]
        return next((found for key, inside in items
                     for found in (unencodable(key, where), unencodable(value[key], inside)) if found), None)
    if isinstance(value, list):
        return next((found for i, item in enumerate(value) if (found := unencodable(item, f"{where}[{i}]"))), None)
    return None

