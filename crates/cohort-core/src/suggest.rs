//! Did-you-mean suggestions for misspelled names.

/// `" (did you mean `x`?)"` for the closest candidate, or an empty string when
/// none is close enough to be a plausible typo.
pub fn did_you_mean<'a>(input: &str, candidates: impl IntoIterator<Item = &'a str>) -> String {
    let input_lower = input.to_ascii_lowercase();
    candidates
        .into_iter()
        .map(|candidate| {
            let score = strsim::jaro_winkler(&input_lower, &candidate.to_ascii_lowercase());
            (score, candidate)
        })
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, candidate)| format!(" (did you mean `{candidate}`?)"))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggests_close_names_only() {
        assert_eq!(
            did_you_mean("per_rond", ["per_round", "total_clients"]),
            " (did you mean `per_round`?)"
        );
        assert_eq!(did_you_mean("zzz", ["per_round", "total_clients"]), "");
    }
}
