# grpolab sandbox worker: runs the untrusted program and answers the judge's calls.
# Executed as `python -I -S -c <wire.py + this file>` inside the sandbox, standard library only.
# Messages arrive on fd 3 and leave on fd 4; the program's stdin, stdout and stderr are /dev/null.
# First message: {"program": source, "names": [...]} -> {"names": {name: "call" | ["value", v] | "missing"}}
#                or {"load_error": "Type: message"} when the program raises (SystemExit included).
# Then: {"call": name, "args": [...], "kwargs": [[k, v], ...]} -> {"ok": value} | {"error": [type, message]}.
import os as _os
import struct as _struct

_read, _write = _os.read, _os.write


def _recv():
    head = b""
    while len(head) < 4:
        chunk = _read(3, 4 - len(head))
        if not chunk:
            _os._exit(0)
        head += chunk
    n = _struct.unpack(">I", head)[0]
    body = bytearray()
    while len(body) < n:
        chunk = _read(3, min(n - len(body), 1 << 20))
        if not chunk:
            _os._exit(0)
        body += chunk
    return parse(bytes(body))


def _send(msg):
    data = frame(msg)
    while data:
        data = data[_write(4, data):]


def _error(e):
    text = str(e)
    return {"error": [type(e).__name__, text[:500]]}


def _main():
    first = _recv()
    ns = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        exec(compile(first["program"], "<program>", "exec"), ns)
    except BaseException as e:   # noqa: BLE001 - sys.exit() in the program is a failed load too
        _send({"load_error": f"{type(e).__name__}: {str(e)[:500]}"})
        return
    names = {}
    for name in first["names"]:
        if name not in ns:
            names[name] = "missing"
        elif callable(ns[name]):
            names[name] = "call"
        else:
            try:
                names[name] = ["value", encode(ns[name])]
            except (WireError, RecursionError):
                names[name] = "missing"
    _send({"names": names})
    while True:
        msg = _recv()
        try:
            args = decode(msg["args"])
            kwargs = {k: v for k, v in decode(msg["kwargs"])}
            reply = {"ok": encode(ns[msg["call"]](*args, **kwargs))}
        except BaseException as e:   # noqa: BLE001 - every failure goes back to the judge as data
            try:
                reply = _error(e)
            except BaseException:   # noqa: BLE001 - an exception whose str() raises
                reply = {"error": ["Exception", "unprintable exception"]}
        _send(reply)


_main()
