//! The GPT's backward stages for the bucketed data-parallel averaging of
//! [`ironweave_sdp::ddp`] (one implementation, shared with the candle adapter): dense
//! gradients are grouped into buckets in the order backward finishes them (head, last layer,
//! ..., first layer, embeddings); a bucket's average starts on a communication thread as soon
//! as its last gradient is final and travels while the remaining layers compute. Bucketed and
//! single-bucket runs are bit-identical ([`ordered_avg`] sums every element in rank order).

use crate::error::{Result, TrainError};

/// Default bucket size. DDP's 25 MB is a few percent of a BERT-scale gradient; ours are a few
/// MB (moe-small's dense gradients: ~2.4 MB), so 512 KiB gives the backward several buckets.
pub const DEFAULT_BUCKET_KB: usize = ironweave_sdp::ddp::DEFAULT_BUCKET_BYTES >> 10;

pub use ironweave_sdp::ddp::{ordered_avg, Bucket, GradSyncStats};

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
/// in backward order ([`ironweave_sdp::ddp::plan_buckets`] with the stages of
/// [`backward_stage`]); `None`: one bucket, ready after the whole backward.
pub fn plan_buckets(params: &[(usize, &str, usize)], layers: usize, bucket_bytes: Option<usize>) -> Result<Vec<Bucket>> {
    let mut staged = Vec::with_capacity(params.len());
    for &(i, name, n) in params {
        staged.push((i, backward_stage(name, layers)?, n));
    }
    Ok(ironweave_sdp::ddp::plan_buckets(&staged, bucket_bytes, layers + 1))
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
    fn the_gpt_s_buckets_follow_its_backward_stages() {
        // the coverage and size rules are ironweave_sdp::ddp's (tested there); here: the
        // GPT's names give the stages, the head's bucket leaves first, None is one bucket
        let p = params(3);
        let refs: Vec<(usize, &str, usize)> = p.iter().map(|(i, n, k)| (*i, n.as_str(), *k)).collect();
        let one = plan_buckets(&refs, 3, None).unwrap();
        assert_eq!((one.len(), one[0].ready_after), (1, 4));
        // 8 + 80 floats of the head fit in 400 bytes
        let b = plan_buckets(&refs, 3, Some(400)).unwrap();
        assert_eq!((b[0].params.clone(), b[0].ready_after), (vec![p.len() - 2, p.len() - 1], 0));
        assert_eq!(b.last().map(|b| b.ready_after), Some(4));
        let mut bad = refs.clone();
        bad.push((99, "mystery", 1));
        assert!(plan_buckets(&bad, 3, Some(400)).is_err());
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
