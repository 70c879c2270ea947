# Converts rTRM's biogrid_mm (an igraph object saved by R) to a plain edge list, without igraph:
# the object is a list whose 3rd and 4th elements are the 0-based endpoints of each edge and
# whose 9th holds the graph, vertex and edge attributes.
load("biogrid_mm.rda")
x <- unclass(biogrid_mm)
info <- x[[9]][[2]]$info
v <- x[[9]][[3]]
e <- x[[9]][[4]]
from <- x[[3]] + 1
to <- x[[4]] + 1
out <- data.frame(
  entrez_a = v$name[from], entrez_b = v$name[to],
  symbol_a = v$label[from], symbol_b = v$label[to],
  systems = vapply(e$exp_sys, function(s) paste(sort(unique(s)), collapse = ";"), ""),
  pubmed = vapply(e$pubmed_id, function(s) paste(sort(unique(s)), collapse = ";"), ""),
  evidence = e$biogrid_count)
con <- file("biogrid-mouse-3.4.128.tsv", "w")
writeLines(c(
  sprintf("# BioGRID %s, Mus musculus physical interactions between mouse proteins (%s)", info$release, info$date),
  "# source: BioGRID (https://thebiogrid.org), MIT License; Oughtred et al., Protein Science 2021",
  "# as packaged by rTRM 1.7.2 (Diego Diez, data/biogrid_mm.rda, github.com/ddiez/rTRM commit 8603c33)",
  "# converted by scripts/orthonets/biogrid_mm_to_tsv.R; one row per interacting pair"), con)
write.table(out, con, sep = "\t", quote = FALSE, row.names = FALSE)
close(con)
