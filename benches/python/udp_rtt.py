"""Round trips of small UDP datagrams across an emulated link, to see how long a message
waits in a host's shaper queue while a benchmark runs (docs/BENCHMARKS.md, the emulated
checkpoint beds). In host 1's namespace: `udp_rtt.py echo` (exits after 200 s without a
datagram); in host 0's: `udp_rtt.py send ADDR N OUT` (N probes 20 ms apart; writes mean,
median, p90 and max in ms to OUT)."""
import socket, sys, time, struct
mode = sys.argv[1]
if mode == "echo":
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 47999)); s.settimeout(200)
    try:
        while True:
            d, a = s.recvfrom(64); s.sendto(d, a)
    except socket.timeout:
        pass
else:
    host, n, out = sys.argv[2], int(sys.argv[3]), sys.argv[4]
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1.0)
    rtts = []
    for i in range(n):
        t = time.perf_counter(); s.sendto(struct.pack("d", t), (host, 47999))
        try:
            d, _ = s.recvfrom(64); rtts.append((time.perf_counter() - struct.unpack("d", d)[0]) * 1e3)
        except socket.timeout:
            rtts.append(float("nan"))
        time.sleep(0.02)
    ok = sorted(r for r in rtts if r == r)
    with open(out, "w") as f:
        f.write(f"n={len(rtts)} lost={len(rtts)-len(ok)} mean={sum(ok)/len(ok):.2f} median={ok[len(ok)//2]:.2f} p90={ok[int(len(ok)*0.9)]:.2f} max={ok[-1]:.2f} ms\n")
