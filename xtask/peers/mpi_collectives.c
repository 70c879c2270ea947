/* OpenMPI side of `cargo xtask bench collectives`: the same ops, sizes and timing rule as
 * `ironweave bench collectives` (float32, in-place all-reduce, nccl-tests size convention:
 * the total buffer), each result checked. Prints one JSON object per row on rank 0. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double now(void) { return MPI_Wtime(); }

static int run(const char *op, float *a, float *b, long count, int n) {
    long per = count / n;
    if (!strcmp(op, "allreduce")) return MPI_Allreduce(MPI_IN_PLACE, a, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (!strcmp(op, "allgather")) return MPI_Allgather(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
    if (!strcmp(op, "reducescatter")) return MPI_Reduce_scatter_block(a, b, (int)per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    if (!strcmp(op, "alltoall")) return MPI_Alltoall(a, (int)per, MPI_FLOAT, b, (int)per, MPI_FLOAT, MPI_COMM_WORLD);
    if (!strcmp(op, "broadcast")) return MPI_Bcast(a, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
    return -1;
}

/* Checks one call on rank-dependent data: value(rank, i) = rank + (i % 7). */
static int verify(const char *op, float *a, float *b, long count, int n, int me) {
    long per = count / n, i;
    for (i = 0; i < count; i++) a[i] = (float)(me + i % 7);
    if (run(op, a, b, count, n) != MPI_SUCCESS) return 0;
    if (!strcmp(op, "allreduce")) {
        for (i = 0; i < count; i++) if (a[i] != (float)(n * (n - 1) / 2 + n * (i % 7))) return 0;
    } else if (!strcmp(op, "allgather")) {
        for (i = 0; i < per * n; i++) if (b[i] != (float)(i / per + (i % per) % 7)) return 0;
    } else if (!strcmp(op, "reducescatter")) {
        for (i = 0; i < per; i++) if (b[i] != (float)(n * (n - 1) / 2 + n * ((me * per + i) % 7))) return 0;
    } else if (!strcmp(op, "alltoall")) {
        for (i = 0; i < per * n; i++) if (b[i] != (float)(i / per + (me * per + i % per) % 7)) return 0;
    } else if (!strcmp(op, "broadcast")) {
        for (i = 0; i < count; i++) if (a[i] != (float)(i % 7)) return 0;
    }
    return 1;
}

int main(int argc, char **argv) {
    int me, n, o, s;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc < 5) {
        if (me == 0) fprintf(stderr, "usage: mpi_collectives LABEL MIN_TIME OPS... -- SIZES...\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const char *label = argv[1];
    double min_time = atof(argv[2]);
    int sep = 3;
    while (sep < argc && strcmp(argv[sep], "--")) sep++;
    for (o = 3; o < sep; o++) {
        for (s = sep + 1; s < argc; s++) {
            long bytes = atol(argv[s]);
            long count = bytes / 4;
            const char *op = argv[o];
            if (strcmp(op, "allreduce") && strcmp(op, "broadcast")) count = count / n * n;
            float *a = calloc((size_t)count + 1, 4), *b = calloc((size_t)count + 1, 4);
            int ok = verify(op, a, b, count, n, me), all_ok;
            MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
            for (long i = 0; i < count; i++) a[i] = 1.0f;
            run(op, a, b, count, n);
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = now(), est, est_max;
            run(op, a, b, count, n);
            est = now() - t0;
            MPI_Allreduce(&est, &est_max, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            long iters = (long)(min_time / (est_max > 1e-7 ? est_max : 1e-7));
            if (iters < 3) iters = 3;
            if (iters > 2000000) iters = 2000000; /* rows of tenths of a microsecond last min_time too */
            MPI_Bcast(&iters, 1, MPI_LONG, 0, MPI_COMM_WORLD);
            MPI_Barrier(MPI_COMM_WORLD);
            t0 = now();
            for (long k = 0; k < iters; k++) run(op, a, b, count, n);
            double t = (now() - t0) / iters, tmax;
            MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (me == 0)
                printf("{\"peer\":\"%s\",\"op\":\"%s\",\"bytes\":%ld,\"ranks\":%d,\"iters\":%ld,\"time_us\":%.3f,\"verified\":%s}\n",
                       label, op, count * 4, n, iters, tmax * 1e6, all_ok ? "true" : "false");
            fflush(stdout);
            free(a);
            free(b);
        }
    }
    MPI_Finalize();
    return 0;
}
