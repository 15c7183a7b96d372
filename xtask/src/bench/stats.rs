//! Order statistics for the bench: median with min and max, percentiles.

/// Median, minimum and maximum of a set of samples.
#[derive(Clone, Copy, Debug)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub n: usize,
}

pub fn summary(samples: &[f64]) -> Option<Summary> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Some(Summary {
        median: median_sorted(&v),
        min: v[0],
        max: v[v.len() - 1],
        n: v.len(),
    })
}

fn median_sorted(v: &[f64]) -> f64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

pub fn median(samples: &[f64]) -> Option<f64> {
    summary(samples).map(|s| s.median)
}

/// Nearest-rank percentile (p in 0..=100).
pub fn percentile(samples: &[f64], p: f64) -> Option<f64> {
    let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    Some(v[rank.clamp(1, v.len()) - 1])
}

/// Mean and its standard error (sample standard deviation / √n); None
/// below two finite samples.
pub fn mean_se(samples: &[f64]) -> Option<(f64, f64)> {
    let v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
    if v.len() < 2 {
        return None;
    }
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0);
    Some((m, (var / n).sqrt()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_percentiles() {
        let s = summary(&[3.0, 1.0, 2.0, 10.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (2.5, 1.0, 10.0, 4));
        let v: Vec<f64> = (1..=100).map(|x| x as f64).collect();
        assert_eq!(percentile(&v, 50.0), Some(50.0));
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        assert!(summary(&[]).is_none());
        // 2, 4, 6: mean 4, sample sd 2, SE 2/√3.
        let (m, se) = mean_se(&[2.0, 4.0, 6.0]).unwrap();
        assert_eq!(m, 4.0);
        assert!((se - 2.0 / 3f64.sqrt()).abs() < 1e-12);
        assert!(mean_se(&[1.0]).is_none());
    }
}
