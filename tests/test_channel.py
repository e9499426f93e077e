"""runtime/channel.py: the output path's framed Unix-socket channel."""

from __future__ import annotations

import os
import threading

import pytest

from loom.runtime.channel import Receiver, Sender, socket_path


def _pair(tmp_path):
    name = f"ipc://{tmp_path}/ch"
    sender = Sender(name)
    return sender, Receiver(name, timeout=5)


def test_messages_arrive_whole_and_in_order(tmp_path):
    sender, receiver = _pair(tmp_path)
    msgs = [b"", b"a", bytes(range(256)) * 3, os.urandom(700_000), b"last"]  # one spans reads
    t = threading.Thread(target=lambda: [sender.send(m) for m in msgs])  # 700 kB > the buffer
    t.start()
    got: list[bytes] = []
    while len(got) < len(msgs):
        got.extend(receiver.read())
    t.join(10)
    assert got == msgs
    assert receiver.read(block=False) == []  # nothing left, and not closed
    assert not receiver.closed
    sender.close()
    assert receiver.read() == [] and receiver.closed  # the sender's end is the stream's end
    receiver.close()


def test_read_takes_every_waiting_message_at_once(tmp_path):
    sender, receiver = _pair(tmp_path)
    for i in range(100):
        sender.send(str(i).encode())
    got: list[bytes] = []
    while len(got) < 100:
        got.extend(receiver.read())
    assert got == [str(i).encode() for i in range(100)]
    sender.close()
    receiver.close()


def test_receiver_waits_for_the_sender_to_listen(tmp_path):
    name = f"ipc://{tmp_path}/late"
    box: list = []
    t = threading.Thread(target=lambda: box.append(Receiver(name, timeout=10)))
    t.start()
    sender = Sender(name)
    sender.send(b"hello")
    t.join(10)
    assert box[0].read() == [b"hello"]
    assert not os.path.exists(socket_path(name))  # the name goes once the pair is connected
    sender.close()
    box[0].close()


def test_receiver_gives_up_after_its_timeout(tmp_path):
    with pytest.raises(TimeoutError, match="nothing listens"):
        Receiver(f"ipc://{tmp_path}/none", timeout=0.05)


def test_only_ipc_names(tmp_path):
    with pytest.raises(ValueError, match="ipc://"):
        Sender("tcp://127.0.0.1:5555")
