//! The GPT's backward stages for the bucketed data-parallel averaging of
//! [`ironweave_shard::ddp`] (one implementation, shared with the candle adapter): dense
//! gradients are grouped into buckets in the order backward finishes them (head, last layer,
//! ..., first layer, embeddings); a bucket's average starts on a communication thread as soon
//! as its last gradient is final and travels while the remaining layers compute. Bucketed and
//! single-bucket runs are bit-identical ([`ordered_avg`] sums every element in rank order).

use crate::error::{Result, TrainError};

/// Default bucket size. DDP's 25 MB is a few percent of a BERT-scale gradient; ours are a few
/// MB (moe-small's dense gradients: ~2.4 MB), so 512 KiB gives the backward several buckets.
pub const DEFAULT_BUCKET_KB: usize = ironweave_shard::ddp::DEFAULT_BUCKET_BYTES >> 10;

pub use ironweave_shard::ddp::{ordered_avg, Bucket, GradSyncStats};

/// Position in the backward pass after which a parameter's gradient is final:
/// 0 = the head (`lnf.*`, `head`), 1 + (L - 1 - l) = layer `l`, L + 1 = the embeddings.
pub fn backward_stage(name: &str, layers: usize) -> Result<usize> {
    if name == "head" || name.starts_with("lnf.") {
        return Ok(0);
    }
    if name == "tok_emb" || name == "pos_emb" {
        return Ok(layers + 1);
    }
    let l = name
        .strip_prefix('l')
        .and_then(|r| r.split('.').next())
        .and_then(|x| x.parse::<usize>().ok())
        .filter(|&l| l < layers)
        .ok_or_else(|| TrainError::Config(format!("parameter `{name}` belongs to no backward stage")))?;
    Ok(1 + (layers - 1 - l))
}

/// Groups the GPT's parameters `(index, name, floats)` into buckets of at most `bucket_bytes`
/// in backward order ([`ironweave_shard::ddp::plan_buckets`] with the stages of
/// [`backward_stage`]); `None`: one bucket, ready after the whole backward.
pub fn plan_buckets(params: &[(usize, &str, usize)], layers: usize, bucket_bytes: Option<usize>) -> Result<Vec<Bucket>> {
    let mut staged = Vec::with_capacity(params.len());
    for &(i, name, n) in params {
        staged.push((i, backward_stage(name, layers)?, n));
    }
    Ok(ironweave_shard::ddp::plan_buckets(&staged, bucket_bytes, layers + 1))
}

/// Seconds of `a` covered by `b` (the overlap scheduler's measure, shared).
pub use ironweave_overlap::covered_s;

#[cfg(test)]
mod tests {
    use super::*;

    fn params(layers: usize) -> Vec<(usize, String, usize)> {
        let mut v = vec![(0, "tok_emb".to_string(), 100), (1, "pos_emb".to_string(), 50)];
        for l in 0..layers {
            v.push((v.len(), format!("l{l}.attn.wq"), 64));
            v.push((v.len(), format!("l{l}.mlp.w1"), 128));
        }
        v.push((v.len(), "lnf.g".into(), 8));
        v.push((v.len(), "head".into(), 80));
        v
    }

    #[test]
    fn stages_follow_the_backward_pass() {
        assert_eq!(backward_stage("head", 4).unwrap(), 0);
        assert_eq!(backward_stage("lnf.b", 4).unwrap(), 0);
        assert_eq!(backward_stage("l3.attn.wq", 4).unwrap(), 1);
        assert_eq!(backward_stage("l0.gate", 4).unwrap(), 4);
        assert_eq!(backward_stage("pos_emb", 4).unwrap(), 5);
        assert!(backward_stage("l4.gate", 4).is_err());
        assert!(backward_stage("mystery", 4).is_err());
    }

    #[test]
    fn buckets_cover_every_parameter_once_in_backward_order() {
        let p = params(3);
        let refs: Vec<(usize, &str, usize)> = p.iter().map(|(i, n, k)| (*i, n.as_str(), *k)).collect();
        for cap in [None, Some(4), Some(400), Some(800), Some(10_000)] {
            let b = plan_buckets(&refs, 3, cap).unwrap();
            let mut seen: Vec<usize> = b.iter().flat_map(|b| b.params.clone()).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..p.len()).collect::<Vec<_>>(), "cap {cap:?}");
            // ready stages never decrease; sizes respect the cap unless one parameter exceeds it
            assert!(b.windows(2).all(|w| w[0].ready_after <= w[1].ready_after));
            for bk in &b {
                assert_eq!(bk.len, bk.params.iter().map(|&i| p[i].2).sum::<usize>());
                if let Some(c) = cap {
                    assert!(bk.len * 4 <= c || bk.params.len() == 1, "{bk:?} over {c}");
                }
            }
        }
        let one = plan_buckets(&refs, 3, None).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(one[0].ready_after, 4);
        // the head's bucket is ready first: 8 + 80 floats fit in 400 bytes
        let b = plan_buckets(&refs, 3, Some(400)).unwrap();
        assert_eq!(b[0].params, vec![p.len() - 2, p.len() - 1]);
        assert_eq!(b[0].ready_after, 0);
    }

    #[test]
    fn coverage_counts_only_overlap() {
        let t = std::time::Instant::now();
        let at = |ms: u64| t + std::time::Duration::from_millis(ms);
        let comm = [(at(10), at(30)), (at(50), at(60))];
        let comp = [(at(0), at(20)), (at(25), at(55))];
        let c = covered_s(&comm, &comp);
        assert!((c - 0.020).abs() < 1e-9, "{c}");
    }
}
