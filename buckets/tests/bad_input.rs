//! Every bad input gets its own clear error naming the offending item, never a panic.

use collsched_buckets::{
    DType, LayoutBuilder, LayoutError, ParamError, ParamFileError, ParamId, ParamSet, ParamSpec, Sharding,
};
use proptest::prelude::*;

fn one(name: &str, shape: &[usize], dtype: DType) -> ParamSet {
    ParamSet::new(vec![ParamSpec::new(name, shape.to_vec(), dtype)]).unwrap()
}

#[test]
fn zero_dimension_names_the_parameter() {
    let err = ParamSet::new(vec![ParamSpec::new("h.3.mlp.w", [4096, 0], DType::BF16)]).unwrap_err();
    assert_eq!(err, ParamError::ZeroDim { name: "h.3.mlp.w".into(), shape: vec![4096, 0], dim: 1 });
    assert!(err.to_string().contains("h.3.mlp.w"));
}

#[test]
fn duplicate_name_names_both_entries() {
    let p = ParamSpec::new("w", [2], DType::F32);
    let err = ParamSet::new(vec![p.clone(), ParamSpec::new("v", [2], DType::F32), p]).unwrap_err();
    assert_eq!(err, ParamError::DuplicateName { name: "w".into(), first: 0, second: 2 });
    let text = err.to_string();
    assert!(text.contains("`w`") && text.contains("#0") && text.contains("#2"), "{text}");
}

#[test]
fn empty_list_and_empty_name() {
    assert_eq!(ParamSet::new(vec![]).unwrap_err(), ParamError::Empty);
    let err = ParamSet::new(vec![ParamSpec::new("", [1], DType::F32)]).unwrap_err();
    assert_eq!(err, ParamError::EmptyName { index: 0 });
}

#[test]
fn overflowing_shape_is_too_large() {
    let err = ParamSet::new(vec![ParamSpec::new("huge", [usize::MAX, 2], DType::F32)]).unwrap_err();
    assert!(matches!(err, ParamError::TooLarge { ref name, .. } if name == "huge"), "{err}");
}

#[test]
fn unknown_dtype_names_the_parameter() {
    let text = r#"{"params": [{"name": "a", "shape": [2], "dtype": "f32"},
                               {"name": "emb", "shape": [2], "dtype": "fp8"}]}"#;
    let err = ParamSet::from_json(text).unwrap_err();
    assert_eq!(err, ParamFileError::UnknownDType { name: "emb".into(), index: 1, dtype: "fp8".into() });
    assert!(err.to_string().contains("emb") && err.to_string().contains("fp8"));
}

#[test]
fn malformed_json_reports_line_and_column() {
    let text = "{\"params\": [\n  {\"name\": \"a\", \"shape\": [2], \"dtype\": \"f32\"},\n  oops\n]}";
    let err = ParamSet::from_json(text).unwrap_err();
    let ParamFileError::Json { line, column, .. } = &err else { panic!("expected a JSON error, got {err}") };
    // `oops` starts on line 3, column 3.
    assert_eq!((*line, *column), (3, 3));
    assert!(err.to_string().contains("line 3 column 3"), "{err}");
}

#[test]
fn wrong_shape_of_file_is_a_json_error() {
    for text in [
        r#"{"parameters": []}"#,
        r#"{"params": [{"name": "a", "shape": [-1], "dtype": "f32"}]}"#,
        r#"{"params": [{"name": "a", "shape": [2], "dtype": "f32", "trainble": false}]}"#,
        r#"[]"#,
        "",
    ] {
        let err = ParamSet::from_json(text).unwrap_err();
        assert!(matches!(err, ParamFileError::Json { .. }), "{text}: {err}");
    }
    // Errors of the list itself come through.
    let err =
        ParamSet::from_json(r#"{"params": [{"name": "z", "shape": [0], "dtype": "f32"}]}"#).unwrap_err();
    assert!(matches!(err, ParamFileError::Param(ParamError::ZeroDim { .. })), "{err}");
}

#[test]
fn world_zero() {
    let err = LayoutBuilder::new(&one("w", &[4], DType::F32), Sharding::EvenSplit, 0).build().unwrap_err();
    assert_eq!(err, LayoutError::ZeroWorld);
}

#[test]
fn hybrid_group_must_divide_the_world() {
    let set = one("w", &[4], DType::F32);
    let err = LayoutBuilder::new(&set, Sharding::Hybrid(3), 8).build().unwrap_err();
    assert_eq!(err, LayoutError::GroupNotDivisor { group: 3, world: 8 });
    assert!(err.to_string().contains("3") && err.to_string().contains("8"));
    let err = LayoutBuilder::new(&set, Sharding::Hybrid(0), 8).build().unwrap_err();
    assert_eq!(err, LayoutError::ZeroGroup { world: 8 });
    assert!(LayoutBuilder::new(&set, Sharding::Hybrid(16), 8).build().is_err());
}

#[test]
fn bucket_bytes_zero() {
    let err = LayoutBuilder::new(&one("w", &[4], DType::F32), Sharding::Flat, 2)
        .bucket_bytes(0)
        .build()
        .unwrap_err();
    assert_eq!(err, LayoutError::ZeroBucketBytes);
}

#[test]
fn alignment_not_a_power_of_two() {
    for align in [0, 3, 96, 384] {
        let err = LayoutBuilder::new(&one("w", &[4], DType::U8), Sharding::Greedy, 2)
            .align(align)
            .build()
            .unwrap_err();
        assert_eq!(err, LayoutError::AlignNotPowerOfTwo { align });
    }
}

#[test]
fn alignment_above_the_limit_is_refused() {
    for align in [2 << 20, 1 << 40] {
        let err = LayoutBuilder::new(&one("w", &[4], DType::U8), Sharding::EvenSplit, 2)
            .align(align)
            .build()
            .unwrap_err();
        assert_eq!(err, LayoutError::AlignTooLarge { align, max: collsched_buckets::MAX_ALIGN });
        assert!(err.to_string().contains("above the limit"), "{err}");
    }
    // The limit itself is accepted.
    LayoutBuilder::new(&one("w", &[4], DType::U8), Sharding::EvenSplit, 2)
        .align(collsched_buckets::MAX_ALIGN)
        .build()
        .expect("1 MiB alignment");
}

#[test]
fn alignment_not_a_multiple_of_the_dtype_names_the_parameter() {
    let set = ParamSet::new(vec![
        ParamSpec::new("ln", [4], DType::BF16),
        ParamSpec::new("acc", [4], DType::F64),
        ParamSpec::new("acc2", [4], DType::F64),
    ])
    .unwrap();
    let err = LayoutBuilder::new(&set, Sharding::EvenSplit, 2).align(4).build().unwrap_err();
    assert_eq!(
        err,
        LayoutError::AlignNotMultipleOfDType { align: 4, dtype: DType::F64, size: 8, param: "acc".into() }
    );
    assert!(err.to_string().contains("`acc`"));
    assert!(LayoutBuilder::new(&set, Sharding::EvenSplit, 2).align(8).build().is_ok());
}

#[test]
fn bad_execution_orders() {
    let set = ParamSet::new(vec![ParamSpec::new("a", [4], DType::F32), ParamSpec::new("b", [4], DType::F32)])
        .unwrap();
    let err = LayoutBuilder::new(&set, Sharding::EvenSplit, 2)
        .order(vec![ParamId(1), ParamId(1)])
        .build()
        .unwrap_err();
    assert_eq!(err, LayoutError::OrderDuplicate { name: "b".into(), first: 0, second: 1 });
    let err = LayoutBuilder::new(&set, Sharding::EvenSplit, 2).order(vec![ParamId(7)]).build().unwrap_err();
    assert_eq!(err, LayoutError::OrderUnknownParam { index: 0, param: ParamId(7), count: 2 });
}

#[test]
fn mask_of_the_wrong_length() {
    let layout = LayoutBuilder::new(&one("w", &[4], DType::F32), Sharding::EvenSplit, 2).build().unwrap();
    let err = layout.with_trainable(&[true, false]).unwrap_err();
    assert_eq!(err, LayoutError::Param(ParamError::MaskLength { got: 2, expected: 1 }));
}

#[test]
fn strategy_names() {
    for (text, s) in [
        ("even", Sharding::EvenSplit),
        ("flat", Sharding::Flat),
        ("greedy", Sharding::Greedy),
        ("hybrid:4", Sharding::Hybrid(4)),
    ] {
        assert_eq!(text.parse::<Sharding>().unwrap(), s);
        assert_eq!(s.to_string(), text);
    }
    for bad in ["", "Even", "hybrid", "hybrid:", "hybrid:0", "hybrid:-2", "zero3"] {
        assert!(bad.parse::<Sharding>().is_err(), "{bad}");
    }
}

#[test]
fn dtype_names_round_trip() {
    for d in DType::ALL {
        assert_eq!(d.name().parse::<DType>().unwrap(), d);
        assert!(d.size().is_power_of_two());
    }
    assert_eq!("torch.bfloat16".parse::<DType>().unwrap(), DType::BF16);
    assert!("fp8".parse::<DType>().is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any valid parameter list survives the file format: written as JSON (with the dtype
    /// spelt in any accepted way, `trainable` sometimes omitted) and parsed back, it is equal.
    #[test]
    fn parser_round_trips(
        ps in prop::collection::vec(
            ("[a-z][a-z0-9._\\\"é]{0,12}", prop::collection::vec(1usize..1000, 0..4), 0usize..6, any::<bool>(), any::<bool>()),
            1..40,
        ),
    ) {
        let mut seen = std::collections::HashSet::new();
        let ps: Vec<_> = ps.into_iter().filter(|p| seen.insert(p.0.clone())).collect();
        let spellings = |d: DType| match d {
            DType::F32 => "float32",
            DType::BF16 => "torch.bfloat16",
            DType::F16 => "half",
            d => d.name(),
        };
        let mut entries = Vec::new();
        let mut specs = Vec::new();
        for (name, shape, d, trainable, alias) in &ps {
            let dtype = DType::ALL[*d];
            let mut e = serde_json::json!({"name": name, "shape": shape, "dtype": if *alias { spellings(dtype) } else { dtype.name() }});
            if !*trainable || *alias {
                e["trainable"] = serde_json::Value::Bool(*trainable);
            }
            entries.push(e);
            specs.push(ParamSpec::new(name.clone(), shape.clone(), dtype).trainable(*trainable));
        }
        let text = serde_json::to_string_pretty(&serde_json::json!({"params": entries})).unwrap();
        let set = ParamSet::from_json(&text).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(set.specs(), &specs[..]);
        for (i, s) in specs.iter().enumerate() {
            prop_assert_eq!(set.id(&s.name), Some(ParamId(i as u32)));
        }
    }

    /// Arbitrary text never panics the parser.
    #[test]
    fn parser_never_panics(text in ".{0,200}") {
        let _ = ParamSet::from_json(&text);
    }

    /// Arbitrary (often bad) builder inputs give a layout or an error, never a panic.
    #[test]
    fn builder_never_panics(
        dims in prop::collection::vec(prop::collection::vec(0usize..5000, 0..3), 1..20),
        world in 0u32..300,
        group in 0u32..40,
        strategy in 0u8..4,
        align in 0usize..1100,
        bucket_bytes in 0usize..100_000,
    ) {
        let specs: Vec<ParamSpec> = dims.iter().enumerate()
            .map(|(i, d)| ParamSpec::new(format!("p{}", i % 7), d.clone(), DType::ALL[i % 6]))
            .collect();
        let Ok(set) = ParamSet::new(specs) else { return Ok(()) };
        let sharding = [Sharding::EvenSplit, Sharding::Flat, Sharding::Greedy, Sharding::Hybrid(group)][strategy as usize];
        let built = LayoutBuilder::new(&set, sharding, world).align(align).bucket_bytes(bucket_bytes).build();
        if let Ok(layout) = built {
            prop_assert!(world > 0 && bucket_bytes > 0 && align.is_power_of_two());
            for b in layout.buckets() {
                for r in 0..world.min(4) {
                    let _ = b.segments(r).count();
                }
            }
        }
    }
}

#[test]
fn parameter_files_carry_optional_modules() {
    let text = r#"{"params": [
        {"name": "h.0.w", "shape": [4], "dtype": "f32", "module": "block.0"},
        {"name": "h.0.b", "shape": [4], "dtype": "f32"}
    ]}"#;
    let set = ParamSet::from_json(text).unwrap();
    assert_eq!(set.specs()[0].module.as_deref(), Some("block.0"));
    assert_eq!(set.specs()[1].module, None);
    // Module keys differ (`block.0` against `h.0`): two buckets by module, one when packed.
    assert_eq!(collsched_buckets::fuzz_parse_params(text).unwrap(), 2 + 1);
    // An empty module is an error naming the parameter; a non-string one is a JSON error.
    let empty = r#"{"params": [{"name": "w", "shape": [4], "dtype": "f32", "module": ""}]}"#;
    let err = ParamSet::from_json(empty).unwrap_err().to_string();
    assert!(err.contains("`w`") && err.contains("empty module"), "{err}");
    let number = r#"{"params": [{"name": "w", "shape": [4], "dtype": "f32", "module": 3}]}"#;
    assert!(matches!(ParamSet::from_json(number), Err(ParamFileError::Json { .. })));
    // A misspelt key is still refused.
    let typo = r#"{"params": [{"name": "w", "shape": [4], "dtype": "f32", "modul": "x"}]}"#;
    assert!(ParamSet::from_json(typo).unwrap_err().to_string().contains("modul"));
}

/// A byte order mark is skipped; a top-level array is named as such; a deep module key is
/// refused with its limit.
#[test]
fn parameter_files_with_a_bom_or_an_array_and_deep_module_keys() {
    let set =
        ParamSet::from_json("\u{feff}{\"params\": [{\"name\": \"w\", \"shape\": [2], \"dtype\": \"f32\"}]}")
            .expect("a BOM is not JSON");
    assert_eq!(set.len(), 1);
    let e = ParamSet::from_json("[]").unwrap_err();
    assert!(e.to_string().contains("JSON array"), "{e}");
    let e = "module:99999999999".parse::<collsched_buckets::Boundary>().unwrap_err();
    assert!(e.to_string().contains("above the limit of 1024"), "{e}");
}
