from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("idempotency_app", "0004_indexes_for_large_tables"),
    ]

    operations = [
        migrations.AlterField(
            model_name="idempotencyrecord",
            name="status",
            field=models.CharField(
                choices=[
                    ("in_progress", "in progress"),
                    ("completed", "completed"),
                    ("released", "released after a validation error"),
                    ("interrupted", "interrupted: outcome unknown"),
                ],
                max_length=16,
            ),
        ),
    ]
