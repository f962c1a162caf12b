use super::*;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tabular")
}

fn spec(format: FileFormat, train: &str, test: Option<&str>) -> FileSpec {
    FileSpec {
        format,
        train_file: fixtures().join(train),
        test_file: test.map(|t| fixtures().join(t)),
        label_column: "label".to_owned(),
        client_column: Some("client".to_owned()),
        test_fraction: None,
        split_seed: 1,
    }
}

fn csv(text: &str) -> Result<Table, FileError> {
    parse_csv(text, Path::new("t.csv"), "label", Some("client"))
}

#[test]
fn a_csv_file_is_features_a_label_and_clients() {
    let table = csv("a, \"b\",label,client\r\n1,2.5,0,3\n\n-1e-3,4,2.0,1\n").unwrap();
    assert_eq!(table.header, ["a", "b", "label", "client"]);
    assert_eq!(table.feature_count, 2);
    assert_eq!(table.features, [1.0, 2.5, -0.001, 4.0]);
    assert_eq!(table.labels, [0, 2]);
    assert_eq!(table.clients, Some(vec![3, 1]));
}

#[test]
fn bad_csv_cells_name_the_file_line_column_and_value() {
    let message = |text: &str| csv(text).unwrap_err().to_string();
    let bad = message("a,label,client\n1,0,0\nx1,1,0\n");
    assert!(
        bad.contains("t.csv")
            && bad.contains("line 3")
            && bad.contains("`a`")
            && bad.contains("`x1`"),
        "{bad}"
    );
    let empty = message("a,label,client\n,0,0\n");
    assert!(
        empty.contains("line 2, column `a`: `` is not a finite number"),
        "{empty}"
    );
    let nan = message("a,label,client\nNaN,0,0\n");
    assert!(nan.contains("`NaN` is not a finite number"), "{nan}");
    let label = message("a,label,client\n1,-1,0\n");
    assert!(
        label.contains("column `label`: `-1` is not a label"),
        "{label}"
    );
    let fraction = message("a,label,client\n1,1.5,0\n");
    assert!(fraction.contains("`1.5` is not a label"), "{fraction}");
    let client = message("a,label,client\n1,1,x\n");
    assert!(
        client.contains("column `client`: `x` is not a client id"),
        "{client}"
    );
    let short = message("a,label,client\n1,1\n");
    assert!(
        short.contains("line 2: 2 cells, but the header has 3 columns"),
        "{short}"
    );
    let missing = parse_csv("a,y\n1,0\n", Path::new("t.csv"), "label", None)
        .unwrap_err()
        .to_string();
    assert!(
        missing.contains("no column `label` (data.label_column); its columns are a, y"),
        "{missing}"
    );
    assert!(message("").contains("is empty"));
    assert!(message("a,label,client\n").contains("no rows"));
    assert!(message("label,client\n0,0\n").contains("no feature column"));
    assert!(message("a,a,label,client\n1,1,0,0\n").contains("named twice"));
}

proptest::proptest! {
    /// Whatever rows are written, they read back as written: the values
    /// (printed as Rust prints f32, which reads back exactly), the labels, the
    /// clients, with the label and client columns anywhere in the header.
    #[test]
    fn csv_rows_read_back_as_written(
        rows in proptest::collection::vec(
            (proptest::collection::vec(-1e6f32..1e6, 3), 0u32..50, 0u32..9), 1..20),
        label_at in 0usize..5,
        client_at in 0usize..5,
    ) {
        let mut names = vec!["x0".to_owned(), "x1".to_owned(), "x2".to_owned()];
        names.insert(label_at.min(names.len()), "label".to_owned());
        names.insert(client_at.min(names.len()), "client".to_owned());
        let mut text = names.join(",") + "\n";
        for (features, label, client) in &rows {
            let mut values = features.iter();
            let cells: Vec<String> = names.iter().map(|name| match name.as_str() {
                "label" => label.to_string(),
                "client" => client.to_string(),
                _ => values.next().unwrap().to_string(),
            }).collect();
            text += &(cells.join(",") + "\n");
        }
        let table = csv(&text).unwrap();
        let features: Vec<f32> = rows.iter().flat_map(|r| r.0.clone()).collect();
        proptest::prop_assert_eq!(table.features, features);
        proptest::prop_assert_eq!(table.labels, rows.iter().map(|r| r.1).collect::<Vec<_>>());
        proptest::prop_assert_eq!(table.clients, Some(rows.iter().map(|r| r.2).collect::<Vec<_>>()));
        proptest::prop_assert_eq!(table.feature_count, 3);
    }

    /// Any text at all is a table or an error naming the file, never a panic;
    /// a table's values are one row of features per label.
    #[test]
    fn any_text_is_a_table_or_an_error(text in "[a-c0-9,.\\-\n\" e]{0,200}") {
        match parse_csv(&text, Path::new("t.csv"), "a", None) {
            Ok(table) => proptest::prop_assert_eq!(table.features.len(), table.labels.len() * table.feature_count),
            Err(error) => proptest::prop_assert!(error.to_string().starts_with("t.csv: ")),
        }
    }

    /// A shape is accepted only with samples and values within the bounds,
    /// however large its dimensions (checked multiplication, no panic).
    #[test]
    fn shapes_are_bounded_without_overflow(shape in proptest::collection::vec(0usize..usize::MAX, 0..5)) {
        match check_shape(Path::new("f"), "x", &shape, false) {
            Ok((count, sample_shape)) => {
                let values = sample_shape.iter().product::<usize>() * count;
                proptest::prop_assert!((1..=MAX_SAMPLES).contains(&count));
                proptest::prop_assert!((1..=MAX_VALUES).contains(&values));
            }
            Err(error) => proptest::prop_assert!(error.to_string().starts_with("f: array `x`")),
        }
    }
}

#[test]
fn shapes_are_samples_then_any_dims() {
    let path = Path::new("f");
    assert_eq!(
        check_shape(path, "x", &[5, 2, 3], false).unwrap(),
        (5, vec![2, 3])
    );
    assert_eq!(check_shape(path, "x", &[5], false).unwrap(), (5, vec![1]));
    assert_eq!(check_shape(path, "y", &[5], true).unwrap(), (5, vec![]));
    assert!(check_shape(path, "y", &[5, 1], true).is_err());
    assert!(check_shape(path, "x", &[], false).is_err());
    assert!(check_shape(path, "x", &[0, 4], false).is_err());
    assert!(check_shape(path, "x", &[4, 0], false).is_err());
    let big = check_shape(path, "x", &[1 << 20, 1 << 20], false).unwrap_err();
    assert!(big.to_string().contains("more than"), "{big}");
}

#[test]
fn the_three_formats_hold_the_same_samples() {
    let csv = load(&spec(FileFormat::Csv, "train.csv", Some("test.csv"))).unwrap();
    let npz = load(&spec(FileFormat::Npz, "tabular.npz", None)).unwrap();
    let st = load(&spec(FileFormat::Safetensors, "tabular.safetensors", None)).unwrap();
    for data in [&csv, &npz, &st] {
        assert_eq!(data.classes, 3);
        assert_eq!((data.splits.train.len(), data.splits.test.len()), (300, 60));
        let users = data.splits.train_users.as_ref().unwrap();
        assert_eq!(users.iter().max(), Some(&5));
        assert_eq!(users, csv.splits.train_users.as_ref().unwrap());
        assert_eq!(data.splits.train.labels, csv.splits.train.labels);
        assert_eq!(data.splits.test.labels, csv.splits.test.labels);
    }
    assert_eq!(csv.splits.train.sample_shape, [4]);
    assert_eq!(npz.splits.train.sample_shape, [2, 2]);
    assert_eq!(npz.splits.train.inputs, csv.splits.train.inputs);
    // float16 in the safetensors file: within its rounding of values below 8.
    let close = st
        .splits
        .train
        .inputs
        .iter()
        .zip(&csv.splits.train.inputs)
        .all(|(a, b)| (a - b).abs() <= 4e-3);
    assert!(close);
}

#[test]
fn the_survey_reads_headers() {
    let npz = survey(&spec(FileFormat::Npz, "tabular.npz", None)).unwrap();
    assert_eq!(
        npz,
        FileSurvey {
            sample_shape: vec![2, 2],
            train_samples: 300,
            test_samples: Some(60),
            has_clients: true,
        }
    );
    let st = survey(&spec(FileFormat::Safetensors, "tabular.safetensors", None)).unwrap();
    assert_eq!(
        (st.sample_shape, st.train_samples, st.test_samples),
        (vec![4], 300, Some(60))
    );
    let csv = survey(&spec(FileFormat::Csv, "train.csv", Some("test.csv"))).unwrap();
    assert_eq!(
        (csv.sample_shape, csv.train_samples, csv.test_samples),
        (vec![4], 300, Some(60))
    );
    let none = survey(&spec(FileFormat::Csv, "train.csv", None)).unwrap_err();
    assert!(none.to_string().contains("data.test_fraction"), "{none}");
}

#[test]
fn a_test_fraction_splits_the_training_file_by_its_seed() {
    let mut fraction = spec(FileFormat::Csv, "train.csv", None);
    fraction.test_fraction = Some(0.2);
    let data = load(&fraction).unwrap();
    assert_eq!((data.splits.train.len(), data.splits.test.len()), (240, 60));
    assert_eq!(data.splits.train_users.as_ref().unwrap().len(), 240);
    assert_eq!(load(&fraction).unwrap(), data, "seeded");
    fraction.split_seed = 2;
    assert_ne!(load(&fraction).unwrap().splits.test, data.splits.test);
    let mut both = spec(FileFormat::Npz, "tabular.npz", None);
    both.test_fraction = Some(0.2);
    assert!(load(&both).unwrap_err().to_string().contains("keep one"));
}

#[test]
fn a_test_csv_needs_the_training_header() {
    let dir = tempfile::tempdir().unwrap();
    let test = dir.path().join("test.csv");
    std::fs::write(&test, "f0,f1,f2,label,client\n1,2,3,0,0\n").unwrap();
    let mut mismatched = spec(FileFormat::Csv, "train.csv", None);
    mismatched.test_file = Some(test.clone());
    let error = load(&mismatched).unwrap_err().to_string();
    assert!(
        error.contains(&*test.to_string_lossy())
            && error.contains("train.csv")
            && error.contains("header"),
        "{error}"
    );
}

#[test]
fn broken_binary_files_are_errors_naming_them() {
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.bin");
    std::fs::write(&junk, b"\xff\xff\xff\xff\xff\xff\xff\x7f{}").unwrap();
    for format in [FileFormat::Npz, FileFormat::Safetensors] {
        let mut broken = spec(format, "x", None);
        broken.train_file = junk.clone();
        let error = load(&broken).unwrap_err();
        assert_eq!(error.path, junk, "{error}");
    }
    // A safetensors file whose header lies about its data's size.
    let full = std::fs::read(fixtures().join("tabular.safetensors")).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &full[..full.len() - 10]).unwrap();
    let mut truncated = spec(FileFormat::Safetensors, "x", None);
    truncated.train_file = cut;
    let error = load(&truncated).unwrap_err().to_string();
    assert!(error.contains("bytes"), "{error}");
}

#[test]
fn client_ids_are_renumbered_in_their_order() {
    assert_eq!(dense(&[70, 3, 70, 1_000_000, 3]), [1, 0, 1, 2, 0]);
    assert_eq!(dense(&[]), Vec::<u32>::new());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

    /// A fixture cut short anywhere, or with one byte changed, is read or
    /// refused naming the file: never a panic, never a wrong-sized split.
    #[test]
    fn damaged_binary_files_never_panic(
        npz in proptest::prelude::any::<bool>(),
        cut in 0.0f64..1.0,
        flip in proptest::prelude::any::<(usize, u8)>(),
    ) {
        let (format, name) = if npz {
            (FileFormat::Npz, "tabular.npz")
        } else {
            (FileFormat::Safetensors, "tabular.safetensors")
        };
        let mut bytes = std::fs::read(fixtures().join(name)).unwrap();
        bytes.truncate(((bytes.len() as f64) * cut) as usize + 1);
        let at = flip.0 % bytes.len();
        bytes[at] ^= flip.1;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes).unwrap();
        let mut damaged = spec(format, name, None);
        damaged.train_file = path.clone();
        match load(&damaged) {
            Ok(data) => {
                proptest::prop_assert!(data.splits.train.check().is_ok());
                proptest::prop_assert!(data.splits.test.check().is_ok());
            }
            Err(error) => proptest::prop_assert_eq!(error.path, path),
        }
        let _ = survey(&damaged);
    }
}

#[test]
fn an_npz_header_asking_for_more_than_its_member_holds_is_refused() {
    // The fixture's `y` member rewritten (stored, not deflated) with a
    // header claiming 2^27 labels and 16 bytes of data.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("lying.npz");
    let header = "{'descr': '<i8', 'fortran_order': False, 'shape': (134217728,), }";
    let mut npy = b"\x93NUMPY\x01\x00".to_vec();
    let padded = format!("{header:<117}\n");
    npy.extend_from_slice(&(padded.len() as u16).to_le_bytes());
    npy.extend_from_slice(padded.as_bytes());
    npy.extend_from_slice(&[0u8; 16]);
    let mut x = b"\x93NUMPY\x01\x00".to_vec();
    let x_header = format!(
        "{:<117}\n",
        "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 2), }"
    );
    x.extend_from_slice(&(x_header.len() as u16).to_le_bytes());
    x.extend_from_slice(x_header.as_bytes());
    x.extend_from_slice(&[0u8; 16]);
    let file = std::fs::File::create(&path).unwrap();
    let mut zip = zip::ZipWriter::new(file);
    let stored =
        zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
    zip.start_file("x.npy", stored).unwrap();
    std::io::Write::write_all(&mut zip, &x).unwrap();
    zip.start_file("y.npy", stored).unwrap();
    std::io::Write::write_all(&mut zip, &npy).unwrap();
    zip.finish().unwrap();
    let mut lying = spec(FileFormat::Npz, "x", None);
    lying.train_file = path;
    lying.test_fraction = Some(0.5);
    let error = load(&lying).unwrap_err().to_string();
    assert!(
        error.contains("array `y` of shape [134217728] needs more bytes"),
        "{error}"
    );
}
