"""How a training message fares on an emulated link beside checkpoint streams: the time of a
transfer of SIZE bytes alone and beside NBULK bulk TCP streams on the same link (its share of
the link), and a 64-byte round trip alone and beside them (the wait in the shaper's queue) —
the two inputs of `ironweave simulate ckpt --from-report DIR --link-sharing SHARE,WAIT`
(docs/BENCHMARKS.md, the simulator against the emulator). With the cluster up (root):
    ip netns exec iw-te4a-h1 python3 benches/python/link_share.py server 120 &
    ip netns exec iw-te4a-h0 python3 benches/python/link_share.py client 10.231.1.2 NBULK SIZE REPS
Prints one line; medians of REPS transfers, 50 ms apart. Standard library only."""
import socket, sys, time, threading, statistics as st
PB, PT, PE = 48001, 48002, 48003
def recv_exact(c, n):
    got = 0
    while got < n:
        b = c.recv(min(1 << 20, n - got))
        if not b: raise EOFError
        got += len(b)
def serve():
    def sink(c):
        try:
            while c.recv(1 << 20): pass
        except Exception: pass
    def xfer(c):
        try:
            while True:
                h = c.recv(8, socket.MSG_WAITALL)
                if len(h) < 8: return
                recv_exact(c, int.from_bytes(h, 'little')); c.sendall(b'k')
        except Exception: pass
    def listen(port, fn):
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', port)); s.listen(16)
        while True:
            c, _ = s.accept(); threading.Thread(target=fn, args=(c,), daemon=True).start()
    for p, f in [(PB, sink), (PT, xfer)]:
        threading.Thread(target=listen, args=(p, f), daemon=True).start()
    time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 300)
def client(addr, nbulk, size, reps):
    def timed(n):
        c = socket.create_connection((addr, PT)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b'\0' * n; out = []
        for _ in range(reps):
            t = time.perf_counter(); c.sendall(n.to_bytes(8, 'little') + buf); c.recv(1); out.append(time.perf_counter() - t)
            time.sleep(0.05)
        c.close(); return st.median(out)
    res = {}
    res['alone_big'] = timed(size); res['alone_small'] = timed(64)
    stop = threading.Event()
    def bulk():
        c = socket.create_connection((addr, PB)); buf = b'\0' * (1 << 20)
        while not stop.is_set(): c.sendall(buf)
        c.close()
    ts = [threading.Thread(target=bulk, daemon=True) for _ in range(nbulk)]
    for t in ts: t.start()
    time.sleep(1.0)
    res['bulk_big'] = timed(size); res['bulk_small'] = timed(64)
    stop.set()
    for t in ts: t.join()
    print(f"bulk flows {nbulk}, transfer {size/1e6:.1f} MB: alone {res['alone_big']*1e3:.1f} ms, beside bulk {res['bulk_big']*1e3:.1f} ms (x{res['bulk_big']/res['alone_big']:.2f}); 64 B round trip alone {res['alone_small']*1e3:.2f} ms, beside bulk {res['bulk_small']*1e3:.2f} ms")
if sys.argv[1] == 'server': serve()
else: client(sys.argv[2], int(sys.argv[3]), int(float(sys.argv[4])), int(sys.argv[5]))
